"""reshard.load of a DTensor job from what is there (issues 22 and 23): without a DTensor layout
of its own mesh and plan, the rank is planned for the job's own placements (a parallel plan
written from its DTensors) over a Hugging Face checkpoint directory, another world size's FSDP2
layout, or a DTensor layout of another plan, and read from there; nothing is stored. 4 gloo
processes, 2x2 (dp_shard x tp, FSDP2 over TP) and 1x4 (tp). Reference: from_pretrained, bit
for bit (full_tensor() of every parameter, every buffer). A flipped byte in a chunk a rank
reads is caught; a job no parallel plan can describe is refused naming the parameter, and so
is a load into parameters FSDP2 holds gathered (after a forward without backward), and a save
of a job whose mesh leaves out some processes."""

import glob
import json
import os
import shutil
import struct

import pytest

from dist_util import HERE, torchrun
from dtensor_common import llama_plan, tiny_llama

WORKER = os.path.join(HERE, "dtensor_anywhere_worker.py")

RULES = [
    {"pattern": "model.embed_tokens.weight", "placements": {"tp": "S(1)"}},
    {"pattern": "model.layers.*.self_attn.o_proj.weight", "placements": {"tp": "S(0)"}},  # not the job's S(1)
    {"pattern": "model.layers.*.self_attn.*_proj.weight", "placements": {"tp": "S(0)"}},
    {"pattern": "lm_head.weight", "placements": {"tp": "S(0)"}}]


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    """A tiny Llama (odd sizes: uneven TP and FSDP shards) written by save_pretrained in bf16."""
    d = tmp_path_factory.mktemp("dtensor-anywhere-src")
    tiny_llama(d)
    return d


def _flip_last_byte_of_every_tensor(path):
    with open(path, "rb") as f:
        data_offset = struct.unpack_from("<Q", f.read(64), 16)[0]  # formats/rank-file.md preamble
    from reshard import _C

    header = json.loads(_C.RankFile.open(str(path)).header_json())
    with open(path, "r+b") as f:
        for t in header["tensors"]:
            if t["nbytes"] == 0:
                continue
            at = data_offset + t["offset"] + t["nbytes"] - 1
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("mesh", ["dp_shard=2,tp=2", "tp=4"])
def test_dtensor_job_loads_from_what_is_there(llama_src, cli, tmp_path, mesh):
    fsdp = mesh.startswith("dp_shard")
    ws3, other, bad = tmp_path / "ws3", tmp_path / "other", tmp_path / "bad"
    cli("convert", llama_src, "-o", ws3, "--world-size", 3, rc=0)
    plan = {"format": "reshard.parallel-plan", "format_version": 1, "name": "other_tp", "rules": RULES}
    if fsdp:
        plan["fsdp"] = {"mesh_dim": "dp_shard"}
    (tmp_path / "other_tp.json").write_text(json.dumps(plan))
    cli("convert", llama_src, "-o", other, "--mesh", mesh, "--plan", tmp_path / "other_tp.json", rc=0)
    shutil.copytree(ws3, bad)
    for f in glob.glob(str(bad / "fsdp2-ws3" / "*.reshard")):
        _flip_last_byte_of_every_tensor(f)
    # The job's own layout converted in parts, one OUT per node (--ranks): each rank reads its
    # node's. And one whose rank files come from another checkpoint's conversion (same plan,
    # same shapes): refused by the manifest's entry, not loaded.
    own = dict(llama_plan("llama_tp"), fsdp={"mesh_dim": "dp_shard"}) if fsdp else llama_plan("llama_tp")
    (tmp_path / "own.json").write_text(json.dumps(own))
    for node in (0, 1):
        cli("convert", llama_src, "-o", tmp_path / f"node{node}", "--mesh", mesh, "--plan", tmp_path / "own.json",
            "--ranks", f"{2 * node}-{2 * node + 1}", rc=0)
    tiny_llama(tmp_path / "src1", seed=1)
    foreign, elsewhere = tmp_path / "foreign", tmp_path / "elsewhere"
    for d, s in ((foreign, llama_src), (elsewhere, tmp_path / "src1")):
        cli("convert", s, "-o", d, "--mesh", mesh, "--plan", tmp_path / "own.json", rc=0)
    (key,) = json.loads((foreign / "reshard.json").read_text())["layouts"]
    for f in glob.glob(str(elsewhere / key / "*.reshard")):  # every rank's: each must refuse (no rank left in
        shutil.copy(f, foreign / key / os.path.basename(f))   # a collective the others skip)
    result = tmp_path / "result"
    result.mkdir()
    sources = [f"hf={llama_src}", f"ws3={ws3}", f"other={other}", f"bad_corrupt={bad}",
               f"split={tmp_path / 'node{node}'}", f"bad_foreign={foreign}"]
    if fsdp:
        sources += [f"partial={llama_src}", f"unsharded={ws3}", f"save_uncovered={tmp_path / 'uncovered'}"]
    torchrun(4, WORKER, llama_src, mesh, result, *sources, timeout=600)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(result / "rank-*.json")))]
    assert len(recs) == 4
    for r in recs:
        loads = r["loads"]
        for name in ("hf", "ws3", "other"):
            got = loads[name]
            assert "error" not in got, (name, got)
            assert got["differ"] == [] and got["params"] > 0 and got["bytes"] > 0, (name, got)
            assert f"mesh {mesh}" in got["source"] and "no conversion stored" in got["source"], got
            assert got["layout"].startswith("dtensor-") and "-live." in got["layout"], got
        assert "Hugging Face checkpoint" in loads["hf"]["source"], loads["hf"]
        assert "fsdp2-ws3" in loads["ws3"]["source"], loads["ws3"]
        assert "other_tp" in loads["other"]["source"], loads["other"]
        got = loads["split"]
        assert "error" not in got and got["differ"] == [] and got["layout"] == key, got
        assert f"layout {key}" in got["source"] and "no conversion stored" not in got["source"], got
        err = loads["bad_foreign"].get("error", "")
        assert "converted from source" in err and f"rank-{r['rank']:05d}-of-00004" in err and "reshard verify" in err, err
        err = loads["bad_corrupt"].get("error", "")
        assert "CorruptFileError" in err and "checksum mismatch" in err and "fsdp2-ws3" in err, err
        if fsdp:
            err = loads["partial"].get("error", "")
            assert "UnsupportedError" in err and "fully_shard the module holding it" in err, err
            assert "model.embed_tokens.weight" in err or "lm_head.weight" in err, err
            got = loads["unsharded"]
            assert got["gathered"].startswith("UnsupportedError") and "the root module" in got["gathered"] \
                and "model.reshard()" in got["gathered"], got
            assert "error" not in got and got["differ"] == [] and "fsdp2-ws3" in got["source"], got
            got = loads["save_uncovered"]
            assert got["error"].startswith("UnsupportedError") and "mesh tp=2 has 2 ranks, the job 4" in \
                got["error"], got
            assert "reshard.json" not in got["wrote"], got
            assert "reshard convert" in err and "--mesh" in err, err
    # Nothing was stored: each OUT holds the layouts it had.
    assert sorted(json.loads((ws3 / "reshard.json").read_text())["layouts"]) == ["fsdp2-ws3"]
    assert len(json.loads((other / "reshard.json").read_text())["layouts"]) == 1
