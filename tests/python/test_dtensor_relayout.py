"""`reshard relayout --mesh M --plan P` (issues 22 + 23): a tensor-parallel job (FSDP2 over TP,
mesh dp_shard=2,tp=2, 4 gloo processes) trained 5 AdamW steps and saved with its optimizer
state, resumed offline on another mesh (tp=4: TP over all 4 ranks, no FSDP). The saved layout
`dtensor-dp_shard2.tp2-saved.<h>` is planned for the new mesh and plan: weights and optimizer
state (dtensor_relayout_worker.py). Also dp_shard=1,tp=4 (1x4: fully_shard over a dim of
size 1), with the plan file's fsdp member.

* The job on tp=4 loads the relayouted layout (not a view over the saved one) and restores the
  optimizer state: every parameter's and state's full_tensor() equals the saved job's bit for
  bit. The next two steps' losses are those of the uninterrupted 2x2 job within 1e-3
  (relative; about 7e-5 seen) and the loss goes down. They cannot be bit-identical across
  meshes even though the weights are: at tp=4 the row-wise layers' (o_proj, down_proj, the
  embeddings) partial sums are all-reduced over 4 ranks in place of 2, so the bf16 forward
  already rounds differently (the first resumed loss differs), and the gradients of the
  replicated parameters (norms) are summed over other groups; AdamW carries that on.
* `reshard verify SAVED` compares the new layout with the saved one element for element
  (optimizer state too); a flipped byte or an edited plan file fails it.
* The reverse: the saved DTensor layout into an FSDP2 layout of world size 3, optimizer state
  included (both hold one tensor per parameter, placed like it), and that FSDP2 layout into a
  DTensor layout again; the tp=4 layout split over two `--ranks` runs; all verified.
* SIGKILL mid-way leaves no listed layout (nothing loads or verifies it); a re-run completes it.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import time

import pytest

import reference_reader as rf
from dist_util import HERE, torchrun
from dtensor_common import llama_plan, tiny_llama

WORKER = os.path.join(HERE, "dtensor_relayout_worker.py")
# What dtensor_save_worker.build's parallelize_module gives (embeddings row-wise).
PLAN = llama_plan("llama_tp_rowemb", row_embeddings=True)
STEPS = 5
MESH0, MESH1 = "dp_shard=2,tp=2", "tp=4"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cli):
    """A tiny Llama (odd vocabulary and widths: uneven TP and FSDP shards) converted for 2x2,
    trained STEPS steps and saved with the optimizer: (dir, conversion, save, results, plan
    file for tp=4, train records)."""
    d = tmp_path_factory.mktemp("dtensor-relayout")
    src = d / "src"
    tiny_llama(src, hidden_size=72, intermediate_size=92, num_key_value_heads=4)
    (d / "plan-fsdp.json").write_text(json.dumps(dict(PLAN, fsdp={"mesh_dim": "dp_shard"})))
    (d / "plan.json").write_text(json.dumps(PLAN))
    out, saved, res = d / "out", d / "saved", d / "res"
    res.mkdir()
    cli("convert", src, "-o", out, "--mesh", MESH0, "--plan", d / "plan-fsdp.json", rc=0)
    torchrun(4, WORKER, "train", out, saved, MESH0, res, STEPS, timeout=300)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(res / "train-rank-*.json")))]
    assert len(recs) == 4
    return d, out, saved, res, d / "plan.json", recs


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _header(path):
    """A rank file's JSON header, read by the format's preamble (formats/rank-file.md)."""
    with open(path, "rb") as f:
        header_offset, header_size = struct.unpack_from("<QQ", f.read(64), 32)
        f.seek(header_offset)
        return json.loads(f.read(header_size))


def _layouts(out):
    return rf.read_manifest(str(out))["layouts"]


# The new meshes: TP over all 4 ranks, as a 1-D mesh (no FSDP) and as 1x4 (fully_shard over a
# dp_shard dim of size 1: FSDP2's placements on it, _StridedShard where TP shards dim 0 too).
NEW_MESHES = {  # mesh: (plan file, key prefix, o_proj's placements, norm's placements)
    "tp=4": ("plan.json", "dtensor-tp4-llama_tp_rowemb.", ["S(1)"], ["R"]),
    "dp_shard=1,tp=4": ("plan-fsdp.json", "dtensor-dp_shard1.tp4-llama_tp_rowemb.", ["S(0)", "S(1)"], ["S(0)", "R"]),
}


@pytest.mark.parametrize("mesh", list(NEW_MESHES))
def test_dtensor_relayout_resume(trained, cli, tmp_path, mesh):
    d, out, saved0, res0, _, train = trained
    plan_name, prefix, o_proj, norm = NEW_MESHES[mesh]
    plan = d / plan_name
    dims = [kv.split("=") for kv in mesh.split(",")]
    saved = _copy(saved0, tmp_path, "saved")
    res = _copy(res0, tmp_path, "res")
    src_key = train[0]["layout"]
    assert src_key.startswith("dtensor-dp_shard2.tp2-saved."), src_key
    r = json.loads(cli("relayout", saved, "--mesh", mesh, "--plan", plan, "--json", rc=0).out)
    key = r["layout"]
    assert r["from"] == src_key and r["optimizer"] and r["committed"] and r["world_size"] == 4, r
    assert key.startswith(prefix), key
    entry = _layouts(saved)[key]
    assert entry["complete"] and entry["from"] == src_key and entry["mesh"] == {"names": [n for n, _ in dims],
                                                                                "shape": [int(x) for _, x in dims]}
    meta = json.load(open(saved / key / "optim" / "optimizer.json"))
    assert meta["layout"] == key
    # The new files are placed by the plan: the state as its parameter.
    h = _header(str(saved / key / "rank-00001-of-00004.reshard"))
    oh = _header(str(saved / key / "optim" / "rank-00001-of-00004.reshard"))
    placed = {t["name"]: t["placements"] for t in h["tensors"]}
    assert placed["model.layers.0.self_attn.o_proj.weight"] == o_proj
    assert placed["model.norm.weight"] == norm
    for t in oh["tensors"]:
        param = t["name"].rsplit("#", 1)[0]
        assert t["placements"] == (placed[param] if t["global_shape"] else ["R"] * len(dims)), t
    cli("verify", saved, rc=0)

    torchrun(4, WORKER, "resume", out, saved, mesh, res, timeout=300)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(res / "resume-rank-*.json")))]
    assert len(recs) == 4
    for rec in recs:
        assert rec["layout"] == key, rec  # the relayouted layout itself, not a view of the saved one
        assert rec["restored"] > 0 and rec["differ"] == [], rec
        assert rec["compared"] > 20, rec
    assert len({tuple(rec["next"]) for rec in recs}) == 1
    got, want = recs[0]["next"], train[0]["next"]
    assert got[1] < got[0] < train[0]["losses"][-1], (got, train[0]["losses"])
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-3 * abs(w), (got, want)

    # verify compares element for element: one flipped byte of a new optimizer file fails it,
    # as does a plan file that is not the layout's.
    bad = _copy(saved, tmp_path, "bad")
    f = bad / key / "optim" / "rank-00002-of-00004.reshard"
    t = next(t for t in _header(str(f))["tensors"] if t["nbytes"] > 8)
    data = bytearray(f.read_bytes())
    data[4096 + t["offset"] + 5] ^= 0x10
    f.write_bytes(bytes(data))
    v = cli("verify", bad, rc=1)
    assert str(f) in v.out and t["name"] in v.out, v.out
    bad2 = _copy(saved, tmp_path, "bad2")
    p = json.loads((bad2 / key / "parallel-plan.json").read_text())
    p["rules"][0]["placements"] = {"tp": "S(1)"}
    (bad2 / key / "parallel-plan.json").write_text(json.dumps(p))
    v = cli("verify", bad2, rc=1)
    assert "parallel-plan.json" in v.out and "xxh3" in v.out, v.out


def test_dtensor_relayout_to_fsdp2_and_refusals(trained, cli, tmp_path):
    d, _, saved0, _, plan, _ = trained
    saved = _copy(saved0, tmp_path, "saved")
    # The reverse: a DTensor layout into FSDP2 (the default kind without --mesh), with the state.
    r = json.loads(cli("relayout", saved, "--world-size", 3, "--json", rc=0).out)
    assert r["layout"] == "fsdp2-ws3" and r["optimizer"] and r["committed"], r
    h = _header(str(saved / "fsdp2-ws3" / "optim" / "rank-00002-of-00003.reshard"))
    assert all(t["shard"] for t in h["tensors"] if t["global_shape"]), h["tensors"][:2]
    cli("verify", saved, rc=0)
    # From an FSDP2 layout (the one just made) into a DTensor layout of the 2x2 mesh under the
    # plan file (not the saved plan: another key), compared with fsdp2-ws3 by verify.
    c = json.loads(cli("relayout", saved, "--mesh", MESH0, "--plan", d / "plan-fsdp.json", "--from", "fsdp2-ws3",
                       "--json", rc=0).out)
    assert c["layout"].startswith("dtensor-dp_shard2.tp2-llama_tp_rowemb.") and c["optimizer"] and c["committed"], c
    assert _layouts(saved)[c["layout"]]["from"] == "fsdp2-ws3"
    # Split: two processes' --ranks of the tp=4 layout; the second one commits.
    a = json.loads(cli("relayout", saved, "--mesh", MESH1, "--plan", plan, "--ranks", "0-1", "--json", rc=0).out)
    assert a["ranks_written"] == [0, 1] and not a["committed"] and a["ranks_missing"] == [2, 3], a
    assert a["layout"] not in _layouts(saved)
    b = json.loads(cli("relayout", saved, "--mesh", MESH1, "--plan", plan, "--ranks", "2-3", "--json", rc=0).out)
    assert b["ranks_written"] == [2, 3] and b["committed"], b
    cli("verify", saved, rc=0)
    # Refusals name what is wrong.
    e = cli("relayout", saved, "--mesh", MESH1, rc=None)
    assert e.rc != 0 and "--plan" in e.err, e.err
    e = cli("relayout", saved, "--world-size", 4, "--mesh", MESH1, "--plan", plan, rc=None)
    assert e.rc != 0 and "--mesh" in e.err, e.err
    big = dict(json.loads(plan.read_text()), rules=[{"pattern": "model.norm.weight", "placements": {"tp": "S(1)"}}])
    (tmp_path / "big.json").write_text(json.dumps(big))
    e = cli("relayout", saved, "--mesh", MESH1, "--plan", tmp_path / "big.json", rc=None)
    assert e.rc != 0 and "model.norm.weight" in e.err, e.err


def test_dtensor_relayout_killed(trained, cli, reshard_bin, tmp_path):
    _, _, saved0, _, plan, _ = trained
    saved = _copy(saved0, tmp_path, "saved")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flags = ["--mesh", MESH1, "--plan", str(plan), "--threads", "1", "--chunk-size", "4096"]
    probe = _copy(saved0, tmp_path, "probe")
    t0 = time.monotonic()
    p = subprocess.run([reshard_bin, "relayout", str(probe), *flags, "--json"], check=True, capture_output=True,
                       text=True, env=env)
    whole = time.monotonic() - t0
    key = json.loads(p.stdout)["layout"]
    rng = random.Random(11)
    unlisted = 0
    for i in range(8):
        p = subprocess.Popen([reshard_bin, "relayout", str(saved), *flags], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)
        time.sleep(rng.uniform(0.0, whole * (0.3 if i == 0 else 0.9)))
        p.send_signal(signal.SIGKILL)
        p.wait()
        if key in _layouts(saved):
            break
        unlisted += 1
        # (optimizer.json may be there already: it is written just before the manifest's entry,
        # and nothing finds a layout the manifest does not list.)
        cli("verify", saved, rc=0)  # the save itself, untouched; the unlisted layout is not checked
    assert unlisted >= 1, "every kill came after the commit: the test proved nothing"
    r = json.loads(cli("relayout", saved, *flags[:4], "--chunk-size", 4096, "--json", rc=0).out)
    assert r["committed"] and r["layout"] == key, r
    cli("verify", saved, rc=0)
