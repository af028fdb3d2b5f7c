"""reshard.save of a DTensor job (issue 22): FSDP2 over tensor parallel on a 2x2 mesh (dp_shard x
tp) and tensor parallel alone on 1x4, 4 gloo processes (dtensor_save_worker.py): convert → load →
save (no training) and AdamW steps → save with the optimizer → a fresh job loads the save:
every parameter's full_tensor(), buffer and optimizer state bit-equal, and the next step too.
Then offline: the saves verify; `reshard export --layout <saved layout>` gives the trained full
tensors byte for byte, and of the save without training the source checkpoint's tensors byte
for byte; a corrupted saved rank file fails verify (and its rank's load, in the worker)."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import reference_reader as rf
from dist_util import HERE, torchrun
from dtensor_common import llama_plan, tiny_llama

WORKER = os.path.join(HERE, "dtensor_save_worker.py")

# What dtensor_save_worker.py's parallelize_module gives (embeddings row-wise: vocab-sharded).
PLAN = llama_plan("llama_tp_rowemb", row_embeddings=True)
STEPS = 3


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    """A tiny Llama written by save_pretrained in bf16: 4 KV heads (one per rank at tp=4, so that
    it trains), an odd vocabulary (uneven TP and FSDP shards of the embeddings and the head)."""
    d = tmp_path_factory.mktemp("dtensor-save-src")
    tiny_llama(d, num_key_value_heads=4)
    return d


def _header(path):
    """A rank file's JSON header, read by the format's preamble (formats/rank-file.md)."""
    import struct

    with open(path, "rb") as f:
        pre = f.read(64)
        header_offset, header_size = struct.unpack_from("<QQ", pre, 32)
        f.seek(header_offset)
        return json.loads(f.read(header_size))


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _exported(d):
    got = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        got.update(load_file(f))
    return got


@pytest.mark.parametrize("mesh,fsdp", [("dp_shard=2,tp=2", True), ("tp=4", False)])
def test_dtensor_save_round_trip_verify_export(llama_src, cli, tmp_path, mesh, fsdp):
    plan = dict(PLAN, fsdp={"mesh_dim": "dp_shard"}) if fsdp else PLAN
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out, saved0, saved, bad, result = (tmp_path / n for n in ("out", "saved0", "saved", "saved-bad", "result"))
    result.mkdir()
    cli("convert", llama_src, "-o", out, "--mesh", mesh, "--plan", tmp_path / "plan.json", rc=0)
    torchrun(4, WORKER, llama_src, out, saved0, saved, bad, mesh, result, STEPS, timeout=600)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(result / "rank-*.json")))]
    assert len(recs) == 4
    mesh_key = mesh.replace("=", "").replace(",", ".")
    key = recs[0]["layout"]
    assert key.startswith(f"dtensor-{mesh_key}-saved."), key
    for r in recs:
        assert r["layout"] == r["layout0"] == r["loaded_layout"] == key, r
        assert r["wrote"] is True
        assert r["differ"] == [], r["differ"]
        assert r["restored"] > 0 and r["state_keys"] == ["exp_avg", "exp_avg_sq", "step"], r
        assert len(r["losses"]) == STEPS and r["losses"][-1] < r["losses"][0], r["losses"]
        a, b = r["next_loss"]
        assert a == b, (a, b)
        assert r["next_differ"] == [], r["next_differ"]
        if fsdp:  # no plan says "fully_shard over dp_shard for the layers only": refused by name
            assert r["partial"].startswith("UnsupportedError") and "model.embed_tokens.weight" in r["partial"] \
                and "fully_shard" in r["partial"], r["partial"]
            assert r["partial_written"] is False
        q = r["placements"]["model.layers.0.self_attn.q_proj.weight"]
        assert q == (["_S(0, 2)", "S(0)"] if fsdp else ["S(0)"]), q
    # The saved plan is the job's placements: a plan file that convert accepts and that gives
    # this very layout key.
    saved_plan = json.loads(recs[0]["plan"])
    assert saved_plan["name"] == "saved" and (saved_plan.get("fsdp") or {}).get("mesh_dim") == (
        "dp_shard" if fsdp else None), saved_plan
    (tmp_path / "saved.json").write_text(recs[0]["plan"])
    again = tmp_path / "again"
    cli("convert", llama_src, "-o", again, "--mesh", mesh, "--plan", tmp_path / "saved.json", rc=0)
    assert key in rf.read_manifest(str(again))["layouts"]

    # The saved rank files: a DTensor layout, each entry with the placements the job reported.
    conv_key = next(iter(rf.read_manifest(str(out))["layouts"]))
    for d in (saved0, saved):
        m = rf.read_manifest(str(d))
        assert list(m["layouts"]) == [key] and m["layouts"][key]["complete"], m["layouts"]
        lay = m["layouts"][key]
        assert lay["kind"] == "dtensor" and lay["mesh"]["shape"] == [int(x.split("=")[1]) for x in mesh.split(",")]
        for rk in lay["ranks"]:
            h = _header(os.path.join(d, key, rk["file"]))
            c = _header(os.path.join(out, conv_key, rk["file"]))
            assert h["coordinate"] == c["coordinate"] and h["source"]["files"] == []
            te = {t["name"]: t for t in h["tensors"]}
            ce = {t["name"]: t for t in c["tensors"]}
            assert sorted(te) == sorted(ce)
            for n, t in ce.items():
                for field in ("placements", "fsdp_mesh_dim", "shard", "global_shape", "local_shape", "dtype"):
                    assert te[n][field] == t[field], (d, rk["rank"], n, field, te[n][field], t[field])
                if d == saved0:  # no training: the same bytes as the conversion
                    assert te[n]["xxh3"] == t["xxh3"], (rk["rank"], n)
        cli("verify", d, rc=0)
    cli("verify", saved / key / "optim", rc=0)

    # Export of the saved layout: the trained model's full tensors, byte for byte.
    trained = torch.load(result / "trained.pt")["params"]
    hf = tmp_path / "hf"
    cli("export", saved, "-o", hf, "--layout", key, rc=0, timeout=300)
    got = _exported(hf)
    assert sorted(got) == sorted(trained)
    for n, t in trained.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(_bits(got[n]), _bits(t)), n
    # Export of the save without training: the source checkpoint, byte for byte.
    hf0 = tmp_path / "hf0"
    cli("export", saved0, "-o", hf0, "--layout", key, rc=0, timeout=300)
    got0, want0 = _exported(hf0), _exported(llama_src)
    assert sorted(got0) == sorted(want0)
    for n, t in want0.items():
        assert got0[n].dtype == t.dtype and torch.equal(_bits(got0[n]), _bits(t)), n
    assert any(not torch.equal(_bits(got[n]), _bits(want0[n])) for n in want0)  # training changed weights

    # A corrupted saved rank file: verify names it; its rank's load failed, the others loaded.
    path, tensor = recs[0]["corrupted"]
    v = cli("verify", bad, rc=1)
    assert os.path.basename(path) in v.text and tensor in v.text, v.text
    for r in recs:
        if r["rank"] == 1:
            assert r["bad_load"].startswith("CorruptFileError") and os.path.basename(path) in r["bad_load"], r
        else:
            assert r["bad_load"] == "loaded", r
