"""Model ids through the local Hugging Face cache (reshard::ResolveSource, one rule for the CLI
and Python), with no network.

The cache is written here exactly as huggingface_hub writes it: ``models--Org--Name/`` with
``blobs/`` (files named by their git blob sha1, or sha256 for LFS files such as weights),
``snapshots/<commit>/`` whose files are relative symlinks into ``blobs/``, ``refs/<name>``
holding the commit hash (no newline), and ``.locks/`` beside the repositories. Each layout is
also looked up with huggingface_hub's own offline lookup (snapshot_download with
local_files_only=True), which must find the same snapshot: the layout is the real one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import pytest

import reshard
from checkpoints import load_source

MAIN = "5b3a2f0e9c1d4b6a8e7f0a1b2c3d4e5f60718293"
DEV = "0f1e2d3c4b5a69788796a5b4c3d2e1f00a1b2c3d"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_snapshot(cache: Path, repo_id: str, src: str, commit: str, ref: Optional[str] = "main",
                   only=None) -> Path:
    """Puts checkpoint directory `src` into hub cache `cache` as revision `commit` of
    `repo_id` (and refs/`ref` -> commit), as huggingface_hub's download does; returns the
    snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    locks = cache / ".locks" / repo.name
    locks.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if only is not None and name not in only:
            continue
        data = Path(src, name).read_bytes()
        lfs = name.endswith((".safetensors", ".bin"))
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        blob = repo / "blobs" / etag
        if not blob.exists():
            blob.write_bytes(data)
        (locks / f"{etag}.lock").touch()
        pointer = snap / name
        if pointer.is_symlink():
            pointer.unlink()
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)  # relative, as hf does
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline
    return snap


def hf_lookup(cache: Path, repo_id: str, revision: Optional[str] = None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True)


@pytest.fixture
def src(checkpoint):
    return checkpoint("qwen2", "bf16", False)


@pytest.fixture
def hub(tmp_path, src, monkeypatch):
    """A hub cache holding Org/Tiny at main (= MAIN) and dev (= DEV, another checkpoint), found
    through HF_HUB_CACHE; the other variables are cleared so the host's cache is never used."""
    cache = tmp_path / "hub"
    cache_snapshot(cache, "Org/Tiny", src, MAIN, "main")
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_layout_is_huggingface_hubs_own(hub, checkpoint):
    cache_snapshot(hub, "Org/Tiny", checkpoint("qwen2", "bf16", False, seed=1), DEV, "dev")
    for rev in (None, "main", "dev", MAIN, DEV):
        want = hf_lookup(hub, "Org/Tiny", rev)
        got = reshard.hub.describe_source("Org/Tiny", rev)
        assert got["path"] == want, (rev, got, want)
        assert got["from_cache"] and got["model_id"] == "Org/Tiny"
    snap = Path(reshard.resolve_source("Org/Tiny"))
    assert (snap / "model.safetensors").is_symlink()
    assert not os.path.isabs(os.readlink(snap / "model.safetensors"))
    assert reshard.hub.hub_cache_dir() == str(hub)


def test_hf_home_and_default_cache(tmp_path, src, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    snap = cache_snapshot(tmp_path / "hfhome" / "hub", "Org/Tiny", src, MAIN)
    assert reshard.resolve_source("Org/Tiny") == str(snap)
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    snap = cache_snapshot(tmp_path / "home" / ".cache" / "huggingface" / "hub", "Org/Tiny", src, DEV)
    assert reshard.resolve_source("Org/Tiny") == str(snap)


def test_convert_verify_inspect_a_model_id(cli, hub, src, tmp_path):
    env = {"HF_HUB_CACHE": str(hub)}
    out = tmp_path / "out"
    r = cli("convert", "Org/Tiny", "-o", out, "--world-size", 2, rc=0, env=env)
    snap = reshard.resolve_source("Org/Tiny")
    assert f"Org/Tiny (revision main, commit {MAIN[:12]}) from the Hugging Face cache: {snap}" in r.err, r
    # The ranks hold exactly the source's bytes: checked against the plain directory too.
    cli("verify", out, "--source", src, rc=0, env=env)
    cli("verify", out, "--source", "Org/Tiny", rc=0, env=env)
    manifest = json.loads((out / "reshard.json").read_text())
    assert set(manifest["aux_files"]) >= {"config.json"}, manifest
    assert not (out / "config.json").is_symlink()  # aux files are copied, not linked into the cache
    assert json.loads((out / "config.json").read_text()) == json.loads(Path(src, "config.json").read_text())
    r = cli("inspect", "Org/Tiny", "--json", rc=0, env=env)
    assert json.loads(r.out)["tensor_count"] == len(load_source(src)), r
    assert r.err == "", r  # --json: nothing but the JSON


def test_convert_of_a_model_id_captures_the_model_manifest_of_its_snapshot(cli, hub, tmp_path):
    env = {"HF_HUB_CACHE": str(hub), "RESHARD_MODEL_CAPTURE": "1", "RESHARD_PYTHON": sys.executable}
    out = tmp_path / "out"
    r = cli("convert", "Org/Tiny", "-o", out, "--world-size", 2, rc=0, env=env)
    assert "capturing the model manifest" in r.err and "no model manifest" not in r.err, r
    model = json.loads((out / "reshard-model.json").read_text())
    assert model["model_class"] == "Qwen2ForCausalLM" and model["params"], model.keys()


def test_revision_ref_and_commit(cli, hub, checkpoint, tmp_path):
    other = checkpoint("qwen2", "bf16", False, seed=1)
    cache_snapshot(hub, "Org/Tiny", other, DEV, "dev")
    env = {"HF_HUB_CACHE": str(hub)}
    for rev in ("dev", DEV):
        out = tmp_path / f"out-{rev[:3]}"
        cli("convert", "Org/Tiny", "--revision", rev, "-o", out, "--world-size", 2, rc=0, env=env)
        cli("verify", out, "--source", other, rc=0, env=env)
        cli("verify", out, "--source", "Org/Tiny", "--revision", rev, rc=0, env=env)
        r = cli("verify", out, "--source", "Org/Tiny", env=env)  # main is another checkpoint
        assert r.rc == 1 and "another checkpoint" in r.out, r


def test_not_cached_names_hf_download(cli, hub, tmp_path):
    env = {"HF_HUB_CACHE": str(hub)}
    r = cli("convert", "Qwen/Qwen2.5-0.5B", "-o", tmp_path / "o", "--world-size", 2, rc=3, env=env)
    assert "not in the Hugging Face cache" in r.err and "hf download Qwen/Qwen2.5-0.5B" in r.err, r
    assert str(hub) in r.err, r
    r = cli("convert", "Org/Tiny", "--revision", "v9", "-o", tmp_path / "o", "--world-size", 2, rc=3, env=env)
    assert "revision v9 is not in the Hugging Face cache" in r.err, r
    assert "hf download Org/Tiny --revision v9" in r.err and "cached refs: main" in r.err, r
    assert not (tmp_path / "o").exists()


def test_partial_snapshot_says_so(cli, tmp_path, src):
    hub = tmp_path / "hub"
    cache_snapshot(hub, "Org/Cfg", src, MAIN, only={"config.json"})  # hf download --include config.json
    r = cli("convert", "Org/Cfg", "-o", tmp_path / "o", "--world-size", 2, rc=3,
            env={"HF_HUB_CACHE": str(hub)})
    assert "not a Hugging Face checkpoint" in r.err and "hf download Org/Cfg" in r.err, r


def test_local_path_wins(cli, hub, checkpoint, tmp_path):
    # ./Org/Tiny exists and holds another checkpoint than the cache's Org/Tiny.
    work = tmp_path / "work"
    local = work / "Org" / "Tiny"
    local.parent.mkdir(parents=True)
    other = checkpoint("qwen2", "bf16", False, seed=1)
    import shutil

    shutil.copytree(other, local)
    env = {"HF_HUB_CACHE": str(hub)}
    cwd = os.getcwd()
    os.chdir(work)
    try:
        r = cli("convert", "Org/Tiny", "-o", work / "out", "--world-size", 2, rc=0, env=env)
        assert "from the Hugging Face cache" not in r.err, r
        cli("verify", work / "out", "--source", local, rc=0, env=env)
        r = cli("convert", "Org/Tiny", "--revision", "main", "-o", work / "out2", "--world-size", 2,
                rc=2, env=env)
        assert "local path" in r.err, r
    finally:
        os.chdir(cwd)
    r = cli("convert", "--help", rc=0)
    assert "A path that exists locally wins over a model id" in " ".join(r.out.split()), r


def test_empty_model_and_check_weights_take_a_model_id(hub, src):
    import torch
    import transformers

    model = reshard.empty_model("Org/Tiny")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert all(p.device.type == "meta" for p in model.parameters())
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    logged = []
    n = reshard.check_weights(ref, "Org/Tiny", log=logged.append)
    assert n == len(list(ref.parameters()))
    # The reference was read from the snapshot the core resolved (not by transformers itself).
    assert reshard.resolve_source("Org/Tiny") in logged[-1], logged
    with pytest.raises(reshard.NotFoundError, match="hf download Org/Missing"):
        reshard.empty_model("Org/Missing")
    with pytest.raises(reshard.NotFoundError, match="hf download Org/Missing"):
        reshard.check_weights(ref, "Org/Missing")
    with pytest.raises(reshard.NotFoundError, match="hf download Org/Tiny --revision nope"):
        reshard.empty_model("Org/Tiny", revision="nope")
