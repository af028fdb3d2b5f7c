"""`reshard relayout` (alias `reshard reshard`): a training checkpoint saved at world size 4
(weights and AdamW state after 10 steps) turned offline into the layouts of world sizes 2, 3
and 6, then resumed (CPU, gloo).

* FSDP2, FSDP1, FSDP1 with use_orig_params: the resumed job's full tensors (every parameter
  and every optimizer state tensor, gathered by torch: full_tensor(), summon_full_params,
  FSDP.optim_state_dict) equal the saved job's bit for bit (relayout_worker.py checks);
  world size 6 is not run: its rank files are reassembled here by the reference reader and
  compared with the same tensors. `reshard verify OUT` compares every new layout with the
  saved one.
* The loss continues: the next steps' losses of the resumed job are those of the uninterrupted
  job within 1e-5 (relative). They cannot be bit-identical across world sizes: every world size
  sees the same global batch (12 sequences split evenly over the ranks), but the gradient mean
  is summed in another order (per-rank means over 12 / W sequences, then the reduce-scatter's
  sum over W ranks), so fp32 rounding differs in the last bits, and AdamW carries that on.
* Refusals, killed runs, a flipped byte in a source chunk, the launcher split.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import reference_reader as rf
from dist_util import dist_env, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "relayout_worker.py")
KINDS = {  # id: (convert flags, worker flags)
    "fsdp2": ([], ["--kind", "fsdp2"]),
    "fsdp1": (["--layout", "fsdp1"], ["--kind", "fsdp1"]),
    "fsdp1-orig": (["--layout", "fsdp1", "--use-orig-params", "--dtype", "fp32"], ["--kind", "fsdp1", "--orig"]),
}
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def _saved(checkpoint, cli, tmp_path, kind):
    """A conversion for world size 4, trained 10 steps and saved with the optimizer state:
    (conversion, saved checkpoint, results with ref.pt)."""
    src = checkpoint("llama", "bf16")
    out, saved, res = tmp_path / "out", tmp_path / "saved", tmp_path / "res"
    out.mkdir()
    res.mkdir()
    if kind != "fsdp2":
        p = subprocess.run([sys.executable, "-m", "reshard.manifest", src, "-o", str(out / "reshard-model.json")],
                           capture_output=True, text=True, env=dist_env())
        assert p.returncode == 0, p.stderr
    cli("convert", src, "-o", out, "--world-size", 4, *KINDS[kind][0], rc=0)
    torchrun(4, WORKER, "--out", out, "--save", saved, "--result", res, *KINDS[kind][1])
    return out, saved, res


@pytest.fixture(scope="module")
def saved_fsdp2(checkpoint, cli, tmp_path_factory):
    """The FSDP2 save, made once for this module's tests; each test copies the checkpoint."""
    return _saved(checkpoint, cli, tmp_path_factory.mktemp("fsdp2"), "fsdp2")


def _copy(saved_dir, tmp_path, name="saved"):
    dst = tmp_path / name
    shutil.copytree(saved_dir, dst)
    return dst


def _relayout(cli, saved, world, *flags, rc=0):
    r = cli("relayout", saved, "--world-size", world, "--json", *flags, rc=rc)
    return json.loads(r.out) if rc == 0 else r


def _tensor(raw: bytes, dtype: str, shape):
    t = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]) if raw else torch.empty(0, dtype=DTYPES[dtype])
    return t.reshape(shape)


class _Raw:
    """A raw-codec rank file of any kind: its header as the C++ reader checks it (the reference
    reader reads FSDP2 files only), its bytes sliced from the file here."""

    def __init__(self, path):
        import reshard

        self.header = json.loads(reshard._C._testing.read_header(str(path)))
        self._data = open(path, "rb").read()
        self._by = {t["name"]: t for t in self.header["tensors"]}

    def read_bytes(self, name):
        t = self._by[name]
        assert t["codec"] == "raw"
        return self._data[4096 + t["offset"]:4096 + t["offset"] + t["nbytes"]]


def _open(path):
    h = _Raw(path)
    return rf.RankFile.open(path) if h.header["layout"]["kind"] == "fsdp2" else h


def _reassemble(saved, key, world):
    """name -> full tensor of every parameter and "<param>#<key>" of every state tensor, from
    the rank files of layout `key` (model and optim/), read here (FSDP2: by the reference
    reader alone): FSDP2
    rows concatenated; FSDP1 flat shards concatenated and cut by their flat objects; FSDP1
    local state likewise (flat-shard state), or concatenated in rank order (use_orig_params)."""
    model = [_open(os.path.join(saved, key, rf.rank_file_name(r, world))) for r in range(world)]
    optim = [_open(os.path.join(saved, key, "optim", rf.rank_file_name(r, world))) for r in range(world)]
    out = {}
    flats = {}
    for t in model[0].header["tensors"]:
        if t.get("flat"):
            flats[t["name"]] = t["flat"]
            flat = b"".join(m.read_bytes(t["name"]) for m in model)
            isz = len(flat) // (world * t["local_shape"][0])
            for p in t["flat"]["params"]:
                n = 1
                for d in p["shape"]:
                    n *= d
                out[p["key"]] = _tensor(flat[p["offset"] * isz:(p["offset"] + n) * isz], t["dtype"], p["shape"])
        elif t["shard"] is not None:
            out[t["name"]] = _tensor(b"".join(m.read_bytes(t["name"]) for m in model), t["dtype"], t["global_shape"])
    meta = json.load(open(os.path.join(saved, key, "optim", "optimizer.json")))
    assert meta["layout"] == key
    if "rank_state" not in meta:  # FSDP2: state sharded like its parameter, or whole
        for t in optim[0].header["tensors"]:
            parts = [o.read_bytes(t["name"]) for o in (optim if t["shard"] is not None else optim[:1])]
            out[t["name"]] = _tensor(b"".join(parts), t["dtype"], t["global_shape"])
        return out
    pieces = {}
    for r, o in enumerate(optim):
        listed = {f"{p}#{k}" for p, d in meta["rank_state"][r].items() for k in d["tensors"]}
        assert listed == {t["name"] for t in o.header["tensors"]}, (r, listed)
        for t in o.header["tensors"]:
            pieces.setdefault(t["name"], []).append((t, o.read_bytes(t["name"])))
    for name, parts in pieces.items():
        param, k = name.rsplit("#", 1)
        t0 = parts[0][0]
        if t0["global_shape"] == []:
            out[name] = _tensor(parts[0][1], t0["dtype"], [])
        elif param in flats:  # the flat shard's state: cut like the flat parameter
            flat = b"".join(raw for _, raw in parts)
            isz = len(flat) // (world * t0["local_shape"][0])
            for p in flats[param]["params"]:
                n = 1
                for d in p["shape"]:
                    n *= d
                out[f"{p['key']}#{k}"] = _tensor(flat[p["offset"] * isz:(p["offset"] + n) * isz], t0["dtype"],
                                                p["shape"])
        else:  # use_orig_params: the parameter's elements, rank after rank
            shape = next(p["shape"] for f in flats.values() for p in f["params"]
                         if (f["unit"] + "." if f["unit"] else "") + p["fqn"] == param)
            out[name] = _tensor(b"".join(raw for _, raw in parts), t0["dtype"], shape)
    return out


def _check_against_ref(got, ref, kind):
    for name, want in ref.items():
        if kind == "fsdp1" and name.endswith("#step"):
            # FSDP.optim_state_dict gives each original parameter its flat parameter's step.
            continue
        assert name in got, (name, sorted(got)[:5])
        g = got[name]
        assert g.dtype == want.dtype and list(g.shape) == list(want.shape), (name, g.dtype, g.shape, want.shape)
        assert torch.equal(g.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8)), name
    if kind == "fsdp1":
        steps = {n: v for n, v in got.items() if n.endswith("#step")}
        assert steps and all(v.item() == 10 for v in steps.values()), steps


@pytest.mark.parametrize("kind,resume", [("fsdp2", (2,)), ("fsdp1", (3,)), ("fsdp1-orig", (2,))])
def test_relayout_resume(checkpoint, cli, tmp_path, request, kind, resume):
    if kind == "fsdp2":
        out, saved, res = request.getfixturevalue("saved_fsdp2")
        saved = _copy(saved, tmp_path)
    else:
        out, saved, res = _saved(checkpoint, cli, tmp_path, kind)
    m = rf.read_manifest(str(saved))
    (key4,) = m["layouts"]
    keys = {}
    for w in (2, 3, 6):
        r = _relayout(cli, saved, w)
        assert r["from"] == key4 and r["optimizer"] and r["committed"] and r["ranks_written"] == list(range(w))
        keys[w] = r["layout"]
        assert os.path.exists(saved / keys[w] / "optim" / "optimizer.json")
    m = rf.read_manifest(str(saved))
    assert all(m["layouts"][keys[w]]["from"] == key4 and m["layouts"][keys[w]]["complete"] for w in keys)
    v = cli("verify", saved, rc=0)
    assert "compared with the layouts they were made from" in v.out, v.out
    # A re-run finds everything up to date.
    assert _relayout(cli, saved, 3)["ranks_up_to_date"] == [0, 1, 2]

    ref = torch.load(res / "ref.pt")
    # World size 6 (no 6-process run): the files themselves, by the reference reader.
    _check_against_ref(_reassemble(str(saved), keys[6], 6), ref, kind)
    # And the saved layout itself reads back as the reference (the reassembly can fail).
    _check_against_ref(_reassemble(str(saved), key4, 4), ref, kind)

    uninterrupted = json.load(open(res / "save-4-rank-0.json"))["more"]
    for w in resume:
        mine = tmp_path / f"resume-{w}"
        mine.mkdir()
        shutil.copy(res / "ref.pt", mine / "ref.pt")
        torchrun(w, WORKER, "--out", out, "--save", saved, "--result", mine, "--mode", "resume", *KINDS[kind][1])
        r0 = json.load(open(mine / f"resume-{w}-rank-0.json"))
        assert r0["layout"] == keys[w] and r0["checked"] == len(ref)
        assert len(r0["more"]) == len(uninterrupted)
        for a, b in zip(r0["more"], uninterrupted):
            assert abs(a - b) <= 1e-5 * abs(b), (w, r0["more"], uninterrupted)


def test_relayout_refusals_and_damage(cli, tmp_path, saved_fsdp2):
    out, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    # The target is the source.
    r = _relayout(cli, saved, 4, rc=3)
    assert "fsdp2-ws4 is the source layout" in r.err, r.err
    # load_optimizer at a world size OUT holds no layout for names the command that makes it.
    res = tmp_path / "refused"
    res.mkdir()
    torchrun(1, WORKER, "--out", out, "--save", saved, "--result", res, "--mode", "refused",
             "--expect", f"reshard relayout {saved} --world-size 1")

    # A truncated optimizer.json of this job's layout: named as damaged, with what to do.
    cut = tmp_path / "cut"
    shutil.copytree(saved, cut)
    _relayout(cli, cut, 1)
    meta = cut / "fsdp2-ws1" / "optim" / "optimizer.json"
    meta.write_bytes(meta.read_bytes()[:40])
    res = tmp_path / "refused-cut"
    res.mkdir()
    torchrun(1, WORKER, "--out", out, "--save", cut, "--result", res, "--mode", "refused",
             "--expect", f"{meta}: not valid JSON (truncated or damaged")

    # A flipped byte in a source chunk: refused naming the file, nothing committed.
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    f = bad / "fsdp2-ws4" / "optim" / rf.rank_file_name(1, 4)
    rank = rf.RankFile.open(str(f))
    t = next(t for t in rank.header["tensors"] if t["nbytes"] > 64)
    data = bytearray(f.read_bytes())
    data[4096 + t["offset"] + 17] ^= 0x10
    f.write_bytes(bytes(data))
    r = _relayout(cli, bad, 2, rc=3)
    assert str(f) in r.err and "checksum" in r.err.lower(), r.err
    assert "fsdp2-ws2" not in rf.read_manifest(str(bad))["layouts"]

    # A missing optimizer rank file: named, nothing written.
    missing = tmp_path / "missing"
    shutil.copytree(saved, missing)
    gone = missing / "fsdp2-ws4" / "optim" / rf.rank_file_name(2, 4)
    gone.unlink()
    r = _relayout(cli, missing, 2, rc=3)
    assert str(gone) in r.err and "missing" in r.err, r.err
    assert not (missing / "fsdp2-ws2").exists()

    # An incomplete source layout (a rank the manifest does not list).
    inc = tmp_path / "incomplete"
    shutil.copytree(saved, inc)
    mj = json.loads((inc / "reshard.json").read_text())
    mj["layouts"]["fsdp2-ws4"]["ranks"].pop()
    mj["layouts"]["fsdp2-ws4"]["complete"] = False
    (inc / "reshard.json").write_text(json.dumps(mj))
    r = _relayout(cli, inc, 2, "--from", "fsdp2-ws4", rc=3)
    assert "incomplete" in r.err and "3 of 4" in r.err, r.err

    # A flipped byte in a written layout: verify names it.
    _relayout(cli, saved, 2)
    f = saved / "fsdp2-ws2" / rf.rank_file_name(0, 2)
    data = bytearray(f.read_bytes())
    t = rf.RankFile.open(str(f)).header["tensors"][0]
    data[4096 + t["offset"] + 3] ^= 0x01
    f.write_bytes(bytes(data))
    v = cli("verify", saved, rc=1)
    assert str(f) in v.out, v.out


def test_verify_out_checks_every_optimizer_file(cli, tmp_path, saved_fsdp2):
    """`reshard verify OUT` of a saved checkpoint checks each layout's optim/ rank files too (not
    listed in the manifest): a flipped byte, a missing rank file, a missing optimizer.json are
    named; for a layout made by relayout the remedy is the relayout command, and following it
    makes the checkpoint verify again."""
    _, saved, _ = saved_fsdp2
    ok = _copy(saved, tmp_path, "ok")
    v = cli("verify", ok, rc=0)
    assert "OK: 8 files" in v.out, v.out  # 4 model + 4 optimizer rank files
    v = cli("verify", ok / "fsdp2-ws4", rc=0)  # the layout alone: its optim/ said to be unchecked
    assert "OK: 4 files" in v.out and f"note: {ok / 'fsdp2-ws4' / 'optim'}: the optimizer state was not checked: " \
        f"reshard verify {ok} checks it" in v.out, v.out

    flip = _copy(saved, tmp_path, "flip")
    f = flip / "fsdp2-ws4" / "optim" / rf.rank_file_name(1, 4)
    t = next(t for t in rf.RankFile.open(str(f)).header["tensors"] if t["nbytes"] > 64)
    data = bytearray(f.read_bytes())
    data[4096 + t["offset"] + 5] ^= 0x04
    f.write_bytes(bytes(data))
    v = cli("verify", flip, rc=1)
    assert f"{f}: tensor \"{t['name']}\"" in v.out and "checksum mismatch" in v.out, v.out

    gone = _copy(saved, tmp_path, "gone")
    (gone / "fsdp2-ws4" / "optim" / rf.rank_file_name(2, 4)).unlink()
    v = cli("verify", gone, rc=1)
    assert f"{gone / 'fsdp2-ws4' / 'optim' / rf.rank_file_name(2, 4)}: rank 2 of 4 is missing" in v.out, v.out

    meta = _copy(saved, tmp_path, "meta")
    (meta / "fsdp2-ws4" / "optim" / "optimizer.json").unlink()
    v = cli("verify", meta, rc=1)
    assert f"{meta / 'fsdp2-ws4' / 'optim' / 'optimizer.json'}: missing" in v.out, v.out

    # A layout made by relayout: the remedy named is the command that writes the rank again.
    made = _copy(saved, tmp_path, "made")
    _relayout(cli, made, 2)
    f = made / "fsdp2-ws2" / "optim" / rf.rank_file_name(1, 2)
    f.write_bytes(f.read_bytes()[:5000])
    v = cli("verify", made, rc=1)
    cmd = f"reshard relayout {made} --world-size 2 --from fsdp2-ws4 --ranks 1-1"
    assert str(f) in v.out and cmd in v.out, v.out
    cli(*cmd.split()[1:], rc=0)
    cli("verify", made, rc=0)
    # A flipped byte (the header intact: the file looks as a re-run would write it): the same
    # remedy writes it again and says so, where it once found the rank up to date.
    f = made / "fsdp2-ws2" / rf.rank_file_name(1, 2)
    t = next(t for t in rf.RankFile.open(str(f)).header["tensors"] if t["nbytes"] > 64)
    data = bytearray(f.read_bytes())
    data[4096 + t["offset"] + 7] ^= 0x10
    f.write_bytes(bytes(data))
    v = cli("verify", made, rc=1)
    assert str(f) in v.out and "checksum mismatch" in v.out and cmd in v.out, v.out
    assert "FAILED: 1 problem(s)" in v.out, v.out  # the comparison with fsdp2-ws4 finds it too: said once
    again = cli(*cmd.split()[1:], rc=0)
    assert "rank 1: the file there was damaged, written again" in again.out and str(f) in again.out, again.out
    cli("verify", made, rc=0)
    r = _relayout(cli, made, 2, "--from", "fsdp2-ws4")
    assert r["ranks_up_to_date"] == [0, 1] and r["ranks_damaged"] == [], r


def test_relayout_in_parts_and_commit_only(cli, tmp_path, saved_fsdp2):
    """A relayout run rank range by rank range (--ranks): each run says which ranks are still
    missing; the run that writes the last one commits; `--commit-only`, the explicit final
    step, fails (exit 3, naming what is missing) while ranks are missing and succeeds after;
    it refuses --ranks / --split-from-env (it writes nothing)."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    r = cli("relayout", saved, "--world-size", 3, "--commit-only", rc=3)
    assert "fsdp2-ws3 not committed: 3 of its 3 rank files are missing" in r.err, r.err
    assert "fsdp2-ws3" not in rf.read_manifest(str(saved))["layouts"]
    r = cli("relayout", saved, "--world-size", 3, "--commit-only", "--ranks", "0-1", rc=2)
    assert "--commit-only" in r.err and "--ranks does not apply" in r.err, r.err
    r = cli("relayout", saved, "--world-size", 3, "--ranks", "1-1", rc=0)
    assert "2 rank file(s) missing: ranks 0, 2" in r.out, r.out
    r = cli("relayout", saved, "--world-size", 3, "--ranks", "0-0", rc=0)
    assert "1 rank file(s) missing: rank 2" in r.out, r.out
    r = cli("relayout", saved, "--world-size", 3, "--commit-only", rc=3)
    assert "1 of its 3 rank files are missing" in r.err, r.err
    r = cli("relayout", saved, "--world-size", 3, "--ranks", "2-2", rc=0)
    assert "is complete and listed" in r.out, r.out
    cli("relayout", saved, "--world-size", 3, "--commit-only", rc=0)
    cli("verify", saved, rc=0)
    # The save's own layout is never rewritten from a copy of it (--from names the copy).
    own = saved / "fsdp2-ws4" / rf.rank_file_name(0, 4)
    before = own.read_bytes()
    r = cli("relayout", saved, "--world-size", 4, "--from", "fsdp2-ws3", "--chunk-size", 8192, rc=3)
    assert "fsdp2-ws4 is already there" in r.err and "never rewrites it from fsdp2-ws3" in r.err, r.err
    assert own.read_bytes() == before and rf.read_manifest(str(saved))["layouts"]["fsdp2-ws3"]["from"] == "fsdp2-ws4"


def test_inspect_a_saved_checkpoint(checkpoint, cli, tmp_path, saved_fsdp2):
    """`reshard inspect` of a checkpoint reshard.save wrote says so (step, save id; it was "0
    weight files"), each layout's optimizer state (class, rank files, bytes) and which layout a
    relayout made it from; --json carries the same; a damaged optim/ is described, not fatal."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    _relayout(cli, saved, 2)
    txt = cli("inspect", saved, rc=0).out
    assert "checkpoint saved from training by reshard.save (step 10, save " in txt, txt
    assert "weight files" not in txt, txt
    assert txt.count("optimizer state (optim/): AdamW, ") == 2, txt
    assert "optimizer state (optim/): AdamW, 4 rank files (complete)" in txt, txt
    assert "made by reshard relayout from layout fsdp2-ws4" in txt, txt
    j = json.loads(cli("inspect", saved, "--json", rc=0).out)
    assert j["saved"]["step"] == 10 and len(j["saved"]["id"]) == 16, j["saved"]
    assert j["layouts"]["fsdp2-ws2"]["from"] == "fsdp2-ws4" and "from" not in j["layouts"]["fsdp2-ws4"]
    op = j["layouts"]["fsdp2-ws4"]["optimizer"]
    assert op["class"] == "AdamW" and op["complete"] and len(op["ranks"]) == 4 and op["nbytes"] > 0, op
    (saved / "fsdp2-ws2" / "optim" / "optimizer.json").unlink()
    (saved / "fsdp2-ws2" / "optim" / rf.rank_file_name(1, 2)).unlink()
    txt = cli("inspect", saved, rc=0).out
    assert "optimizer state (optim/): 1 rank file (INCOMPLETE)" in txt and "optimizer.json: missing" in txt, txt
    # A conversion's output: as before, no optimizer lines.
    out = tmp_path / "conv"
    cli("convert", checkpoint("llama", "bf16"), "-o", out, "--world-size", 2, rc=0)
    txt = cli("inspect", out, rc=0).out
    assert "reshard output of source" in txt and "optimizer" not in txt, txt
    assert json.loads(cli("inspect", out, "--json", rc=0).out)["layouts"]["fsdp2-ws2"]["optimizer"] is None


def test_fsdp2_save_into_fsdp1_says_the_weights_only_way(cli, tmp_path, saved_fsdp2):
    """An FSDP2 save with optimizer state into --layout fsdp1: refused first for the optimizer
    (before asking for a model manifest that would not help), naming the weights-only way
    (export, convert); following it word for word gives an FSDP1 layout that verifies against
    the export, whose weights are the save's. Without optimizer state in the way, the FSDP1
    target asks for the model manifest of OUT itself (a save builds from its own config)."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    r = cli("relayout", saved, "--world-size", 2, "--layout", "fsdp1", rc=3)
    assert "optimizer state of layout fsdp2-ws4 (fsdp2) into fsdp1-" in r.err, r.err
    assert "reshard.model_manifest" not in r.err, r.err
    _relayout(cli, saved, 2)  # a second layout: the export must name the one it writes
    export = f"reshard export {saved} -o {saved}-hf --layout fsdp2-ws4"
    convert = f"reshard convert {saved}-hf -o {saved}-fsdp1-ws2 --world-size 2 --layout fsdp1"
    assert f"For the weights alone (the optimizer starting afresh): {export}, then {convert} " in r.err, r.err
    cli(*export.split()[1:], rc=0)
    cli(*convert.split()[1:], rc=0, env={"RESHARD_MODEL_CAPTURE": "1"})  # as a user's convert captures
    cli("verify", f"{saved}-fsdp1-ws2", "--source", f"{saved}-hf", rc=0)
    ref = _reassemble(str(saved), "fsdp2-ws4", 4)
    from safetensors.torch import load_file
    got = load_file(f"{saved}-hf/model.safetensors")
    assert ref and all(torch.equal(got[n], t) for n, t in ref.items() if "#" not in n), sorted(ref)[:4]
    shutil.rmtree(saved / "fsdp2-ws4" / "optim")  # weights only: the model manifest is what is missing
    r = cli("relayout", saved, "--world-size", 2, "--layout", "fsdp1", rc=3)
    assert f"python -m reshard.model_manifest {saved} -o {saved / 'reshard-model.json'}" in r.err, r.err


def test_remove_layouts(cli, tmp_path, saved_fsdp2):
    """`reshard remove OUT KEY...`: a layout deleted by hand is said once by verify (was one
    problem per file) with the remove command, and inspect still shows the others; remove takes
    it out of reshard.json; removing the layout others were made from leaves them standing alone
    (their `from` dropped; verify passes on checksums); refused, nothing changed: an unknown key,
    every layout at once."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    for w in (2, 3):
        _relayout(cli, saved, w)
    shutil.rmtree(saved / "fsdp2-ws3")
    v = cli("verify", saved, rc=1)
    assert (f"{saved / 'fsdp2-ws3'}: the directory of layout fsdp2-ws3 (listed in the manifest) is missing; take it "
            f"out of the manifest with: reshard remove {saved} fsdp2-ws3") in v.out and "FAILED: 1 problem(s)" in v.out, v.out
    txt = cli("inspect", saved, rc=0).out
    assert "layout fsdp2-ws3: world size 3, MISSING" in txt and "layout fsdp2-ws2: world size 2, 2 rank files" in txt, txt
    r = cli("remove", saved, "fsdp2-ws3", rc=0)
    assert "removed layout fsdp2-ws3" in r.out and "lists: fsdp2-ws2 fsdp2-ws4" in r.out, r.out
    cli("verify", saved, rc=0)
    manifest = (saved / "reshard.json").read_bytes()
    r = cli("remove", saved, "fsdp2-ws9", rc=3)
    assert "lists no layout fsdp2-ws9; its layouts: fsdp2-ws2, fsdp2-ws4" in r.err, r.err
    r = cli("remove", saved, "fsdp2-ws2", "fsdp2-ws4", rc=3)
    assert "removing every layout (fsdp2-ws2, fsdp2-ws4) leaves nothing to load" in r.err, r.err
    assert (saved / "reshard.json").read_bytes() == manifest and (saved / "fsdp2-ws2").is_dir()
    j = json.loads(cli("remove", saved, "fsdp2-ws4", "--json", rc=0).out)
    assert j == {"removed": ["fsdp2-ws4"], "unlinked": ["fsdp2-ws2"], "remaining": ["fsdp2-ws2"]}, j
    assert not (saved / "fsdp2-ws4").exists()
    m = rf.read_manifest(str(saved))
    assert list(m["layouts"]) == ["fsdp2-ws2"] and "from" not in m["layouts"]["fsdp2-ws2"], m["layouts"]
    v = cli("verify", saved, rc=0)
    assert "compared with the layouts they were made from" not in v.out, v.out
    # The layout left is a whole checkpoint: its weights as saved, its optimizer state there.
    assert _relayout(cli, saved, 4)["from"] == "fsdp2-ws2"
    cli("verify", saved, rc=0)


def test_a_damaged_original_is_made_again_from_its_copy(cli, tmp_path, saved_fsdp2):
    """A save's own layout damaged (a flipped byte) or gone, a relayout-made copy intact: verify
    names the way out (remove it, relayout it from the copy; was "save it again"), relayout's
    refusals say the same (one claimed OUT held no other layout), and following it word for word
    makes a checkpoint that verifies, the original's bytes as before."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    _relayout(cli, saved, 2)
    f = saved / "fsdp2-ws4" / rf.rank_file_name(1, 4)
    good = f.read_bytes()
    t = next(t for t in rf.RankFile.open(str(f)).header["tensors"] if t["nbytes"] > 64)
    data = bytearray(good)
    data[4096 + t["offset"] + 3] ^= 0x08
    f.write_bytes(bytes(data))
    v = cli("verify", saved, rc=1)
    remove = f"reshard remove {saved} fsdp2-ws4"
    again = f"reshard relayout {saved} --world-size 4 --from fsdp2-ws2"
    assert f"take it out and make it from there: {remove}, then {again}" in v.out, v.out
    r = cli("relayout", saved, "--world-size", 4, "--from", "fsdp2-ws2", rc=3)
    assert f"if it is damaged or gone, take it out first: {remove}, then run this again" in r.err, r.err
    r = cli("relayout", saved, "--world-size", 4, rc=3)
    assert "already listed, as this checkpoint's own (the others, fsdp2-ws2, were made from it)" in r.err, r.err
    cli(*remove.split()[1:], rc=0)
    cli(*again.split()[1:], rc=0)
    cli("verify", saved, rc=0)
    assert f.read_bytes() == good  # the same bytes as saved, made again from the copy
    # The original (now fsdp2-ws2: fsdp2-ws4 was made from it) gone by hand: the same way out.
    shutil.rmtree(saved / "fsdp2-ws2")
    v = cli("verify", saved, rc=1)
    remove = f"reshard remove {saved} fsdp2-ws2"
    again = f"reshard relayout {saved} --world-size 2 --from fsdp2-ws4"
    assert f"take it out and make it from fsdp2-ws4 (made from it, the same state): {remove}, then {again}" in v.out, v.out
    cli(*remove.split()[1:], rc=0)
    cli(*again.split()[1:], rc=0)
    cli("verify", saved, rc=0)


def test_rerun_writes_only_the_files_missing(cli, tmp_path, saved_fsdp2):
    """A re-run writes a rank's model file and its optimizer file apart: a run killed after a
    rank's optimizer file (written first) had it complete; the re-run once wrote it again too
    (the optimizer state is most of the bytes). Here: rank 1's model file gone, rank 2's
    optimizer file gone; each is written, the other files keep their inodes, and it verifies."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    _relayout(cli, saved, 3)
    d = saved / "fsdp2-ws3"
    files = {p: os.stat(p).st_ino for p in [*d.glob("rank-*.reshard"), *(d / "optim").glob("rank-*.reshard")]}
    gone = [d / rf.rank_file_name(1, 3), d / "optim" / rf.rank_file_name(2, 3)]
    for p in gone:
        p.unlink()
    r = _relayout(cli, saved, 3)
    assert r["ranks_written"] == [1, 2] and r["ranks_up_to_date"] == [0] and r["committed"], r
    for p, ino in files.items():
        assert p.exists() and (p in gone or os.stat(p).st_ino == ino), p
    cli("verify", saved, rc=0)


def test_verify_notes_leftovers(cli, tmp_path, saved_fsdp2):
    """`reshard verify OUT` says what a killed write left (it verified OK and said nothing):
    temporary files in a listed layout's directory or its optim/, a directory of rank files the
    manifest does not list; notes, not problems (exit 0), with what to do; --json lists them."""
    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    _relayout(cli, saved, 2)
    assert "note:" not in cli("verify", saved, rc=0).out
    (saved / "fsdp2-ws2" / "optim" / ".rank-00001-of-00002.reshard.tmp-somehost-4242").write_bytes(b"x" * 5000)
    shutil.copytree(saved / "fsdp2-ws2", saved / "fsdp2-ws5")
    v = cli("verify", saved, rc=0)
    assert (f"note: {saved / 'fsdp2-ws2'}: 1 temporary file(s) (5.00 KB) of an unfinished write; if no convert, "
            "relayout or save is writing into") in v.out, v.out
    # Named for another host: a re-run here leaves it (only this host's dead writers' are removed).
    assert "some were written on another host (somehost): a re-run here leaves those" in v.out, v.out
    assert (f"note: {saved / 'fsdp2-ws5'}: 4 rank file(s) and 1 temporary file(s) (5.00 KB), not a layout "
            "reshard.json lists") in v.out, v.out
    j = json.loads(cli("verify", saved, "--json", rc=0).out)
    assert j["ok"] and len(j["notes"]) == 2 and j["problems"] == [], j
    txt = cli("inspect", saved, rc=0).out
    assert "not listed: fsdp2-ws5/ (5 rank or temporary files: a convert or relayout into it did not finish" in txt, txt
    # An OUT whose first conversion did not finish (its lock, no reshard.json yet): inspect says so.
    kc = tmp_path / "kc"
    (kc / "fsdp2-ws2").mkdir(parents=True)
    (kc / ".reshard.lock").write_bytes(b"")
    r = cli("inspect", kc, rc=3)
    assert "no reshard.json yet: a reshard convert into it started and did not finish; run it again" in r.err, r.err


def test_model_manifest_of_a_saved_checkpoint(tmp_path, saved_fsdp2, capsys):
    """`python -m reshard.model_manifest` (which relayout's FSDP1 refusal tells users to run) on
    a checkpoint reshard.save wrote: a manifest with no conversion (the names are the model's);
    on a conversion's output or an unbuildable config: exit 3 with a message, no traceback."""
    from reshard import model_manifest

    _, saved, _ = saved_fsdp2
    saved = _copy(saved, tmp_path)
    assert model_manifest.main([str(saved), "-o", str(saved / "reshard-model.json")]) == 0
    m = json.loads((saved / "reshard-model.json").read_text())
    assert "conversion" not in m and m["model_class"] and m["params"], sorted(m)
    assert "no conversion" in capsys.readouterr().out
    conv = tmp_path / "conv"
    conv.mkdir()
    shutil.copy(saved / "config.json", conv / "config.json")
    (conv / "reshard.json").write_text(json.dumps({"source": {"files": [], "fingerprint": "0" * 16}}))
    assert model_manifest.main([str(conv), "-o", str(tmp_path / "x.json")]) == 3
    assert "the output of reshard convert" in capsys.readouterr().err
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{}")
    assert model_manifest.main([str(junk), "-o", str(tmp_path / "y.json")]) == 3
    assert "model_type" in capsys.readouterr().err and not (tmp_path / "y.json").exists()


def test_load_errors_never_suggest_converting_into_a_saved_checkpoint(tmp_path, saved_fsdp2):
    """The command load errors suggest (convert_command): into OUT for a conversion's output, a
    new directory (and relayout for another world size) for a checkpoint reshard.save wrote,
    which convert refuses to write into."""
    from reshard.load import convert_command

    _, saved, _ = saved_fsdp2
    c = convert_command(str(saved), "--world-size 3")
    assert c.startswith("reshard convert <checkpoint> -o OUT --world-size 3") and \
        f"reshard relayout {saved} --world-size 3" in c, c
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / "reshard.json").write_text(json.dumps({"source": {"files": [], "fingerprint": "0" * 16}}))
    assert convert_command(str(conv), "--world-size 3") == f"reshard convert <checkpoint> -o {conv} --world-size 3"


def test_paths_near_a_checkpoint_are_named(cli, tmp_path, saved_fsdp2):
    """OUT given as a path near a checkpoint (a --save-dir of step-* checkpoints, a layout
    directory, a rank file, nothing at all, a Hugging Face checkpoint): relayout, verify, inspect
    and reshard.load say what it is and what to pass instead (ops/path_hint.cc, in C++, and
    reshard.layout.path_hint)."""
    from reshard.layout import path_hint

    _, saved, _ = saved_fsdp2
    runs = tmp_path / "runs"
    runs.mkdir()
    step = _copy(saved, runs, "step-00000010")
    want = f"pass one, e.g. {step}"
    for args in (("relayout", runs, "--world-size", 3), ("inspect", runs)):
        r = cli(*args, rc=3)
        assert want in r.err, r.err
    assert want in cli("verify", runs, rc=3).err
    assert want in path_hint(str(runs))
    layout = step / "fsdp2-ws4"
    r = cli("relayout", layout, "--world-size", 3, rc=3)
    assert f"a layout directory of {step}: pass that directory" in r.err, r.err
    assert path_hint(str(layout)).startswith(f"a layout directory of {step}")
    assert path_hint(str(layout / "optim")).startswith(f"a layout directory of {step}")
    assert f"({step})" in path_hint(str(layout / rf.rank_file_name(0, 4)))
    assert path_hint(str(layout / "optim" / rf.rank_file_name(0, 4))).endswith(f"({step}), and each rank finds "
                                                                              "its own file")
    assert "no such file or directory" in cli("relayout", tmp_path / "nope", "--world-size", 3, rc=3).err
    assert path_hint(str(tmp_path / "nope")) == "no such file or directory"
    assert path_hint(str(tmp_path)) == ""  # nothing better to say than "no reshard.json"


def test_relayout_killed_and_split(checkpoint, cli, reshard_bin, tmp_path, saved_fsdp2):
    saved = _copy(saved_fsdp2[1], tmp_path)
    rng = random.Random(7)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # SIGKILL at random points: the new layout is listed only when complete (and then
    # verifies); a re-run completes it.
    # Kill times within a whole run's duration on this machine (measured on a copy), the first
    # in its first third: a fixed range would let a fast machine finish before every kill.
    flags = ["--world-size", "3", "--threads", "1", "--chunk-size", "4096"]
    probe = _copy(saved_fsdp2[1], tmp_path, "probe")
    t0 = time.monotonic()
    subprocess.run([reshard_bin, "relayout", str(probe), *flags], check=True, capture_output=True, env=env)
    whole = time.monotonic() - t0
    unlisted = 0
    for i in range(8):
        p = subprocess.Popen([reshard_bin, "relayout", str(saved), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(rng.uniform(0.0, whole * (0.3 if i == 0 else 0.9)))
        p.send_signal(signal.SIGKILL)
        p.wait()
        listed = "fsdp2-ws3" in rf.read_manifest(str(saved))["layouts"]
        if listed:
            cli("verify", saved, rc=0)
            break
        v = cli("verify", saved, rc=0)  # the save itself is untouched
        # (optimizer.json may be there already: it is written just before the manifest's entry,
        # and nothing finds a layout the manifest does not list.) What the killed run left is
        # said, with what to do.
        left = [f for d in (saved / "fsdp2-ws3", saved / "fsdp2-ws3" / "optim") if d.is_dir() for f in os.listdir(d)
                if f.startswith("rank-") or ".tmp-" in f]
        if left:
            assert f"note: {saved / 'fsdp2-ws3'}: " in v.out and "not a layout reshard.json lists" in v.out, v.out
        unlisted += 1
    assert unlisted >= 1, "every kill came after the commit: the test proved nothing"
    r = _relayout(cli, saved, 3, "--chunk-size", 4096)
    assert r["committed"]
    cli("verify", saved, rc=0)

    # The launcher split: 3 processes (Slurm array ids 1-3), each its ranks of 6 into one OUT;
    # whichever finishes last commits. torchrun's WORLD_SIZE is the launcher's process count.
    procs = []
    for task in (1, 2, 3):
        e = dict(env, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT="3", SLURM_ARRAY_TASK_MIN="1")
        procs.append(subprocess.Popen([reshard_bin, "relayout", str(saved), "--world-size", "6", "--split-from-env",
                                       "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [o["ranks_written"] for o in outs] == [[0, 1], [2, 3], [4, 5]], outs
    assert any(o["committed"] for o in outs), outs
    cli("verify", saved, rc=0)
    e = dict(env, RANK="1", WORLD_SIZE="4")
    r = subprocess.run([reshard_bin, "relayout", str(saved), "--world-size", "2", "--split-from-env", "--json"],
                       capture_output=True, text=True, env=e)
    j = json.loads(r.stdout)
    assert j["ranks_written"] == [1] and not j["committed"] and j["ranks_missing"] == [0], j
    e = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE") and not k.startswith("SLURM_")}
    r = subprocess.run([reshard_bin, "relayout", str(saved), "--world-size", "2", "--split-from-env"],
                       capture_output=True, text=True, env=e)
    assert r.returncode == 2 and "none of SLURM_ARRAY_TASK_ID" in r.stderr and "RANK/WORLD_SIZE" in r.stderr, r.stderr
    r = subprocess.run([reshard_bin, "relayout", str(saved), "--world-size", "2", "--split-from-env"],
                       capture_output=True, text=True, env=dict(e, RANK="1"))
    assert r.returncode == 2 and "RANK=1 is set but WORLD_SIZE is not, and no complete pair of" in r.stderr, r.stderr

    # reshard convert splits the same way: two torchrun-like processes, one shared OUT.
    src = checkpoint("llama", "bf16")
    conv = tmp_path / "conv"
    procs = [subprocess.Popen([reshard_bin, "convert", src, "-o", str(conv), "--world-size", "3", "--no-capture",
                               "--split-from-env", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(env, RANK=str(i), WORLD_SIZE="2")) for i in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    written = sorted(r for o, _ in outs for r in json.loads(o)["ranks_written"])
    assert written == [0, 1, 2], outs
    assert rf.read_manifest(str(conv))["layouts"]["fsdp2-ws3"]["complete"]
    cli("verify", conv, "--source", src, rc=0)
