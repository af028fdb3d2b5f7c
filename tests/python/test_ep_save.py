"""reshard.save of an expert-parallel job as torchtitan arranges it (issue 22), 4 gloo processes
(tests/python/ep_save_worker.py): the tiny Mixtral of test_dtensor_moe.py, experts Shard(0) over
ep=2 and fully_shard'ed over efsdp=2, the rest fully_shard'ed over a 1-D fsdp=4 mesh; loaded
from the Hugging Face checkpoint, 3 AdamW steps, saved with its optimizer. OUT then holds two
layouts committed by one manifest: the experts (and their state) as the DTensor layout of
their mesh, the dense parameters (and their state, and the persistent buffers) as fsdp2-ws4.
A fresh job's reshard.load + reshard.load_optimizer gives every parameter and state tensor
(and a persistent buffer the worker adds) bit for bit, and the next step the uninterrupted job's loss and parameters; a job with the experts
placed otherwise is refused by load_optimizer, naming the parameter, before any state changes.
`reshard verify OUT` is OK; `reshard export` needs --layout and writes that layout's part (the
two parts are disjoint and together the saved model, bit for bit). A commit whose second
layout lacks a rank file leaves no reshard.json."""

import glob
import json
import os
import shutil

import pytest
import torch

import reshard
from dist_util import HERE, torchrun
from dtensor_common import tiny_mixtral

WORKER = os.path.join(HERE, "ep_save_worker.py")
EXPERTS = {f"model.layers.{i}.mlp.experts.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep-save")
    src, result, out = d / "src", d / "result", d / "out"
    tiny_mixtral(src)
    result.mkdir()
    torchrun(4, WORKER, result, src, out, timeout=300)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(result / "rank-*.json")))]
    assert len(recs) == 4
    return out, recs, torch.load(result / "saved.pt")


def _layouts(out):
    manifest = json.load(open(out / "reshard.json"))
    dt = [k for k in manifest["layouts"] if k.startswith("dtensor-efsdp2.ep2-saved.")]
    assert len(dt) == 1 and sorted(manifest["layouts"]) == sorted(dt + ["fsdp2-ws4"]), manifest["layouts"]
    assert all(v["complete"] for v in manifest["layouts"].values())
    # Each layout says it holds part of the model, naming both (formats/manifest.md).
    assert all(v["parts"] == sorted(dt + ["fsdp2-ws4"]) for v in manifest["layouts"].values()), manifest
    return manifest, dt[0]


def test_ep_save_resumes_exactly(saved):
    out, recs, params = saved
    manifest, dt = _layouts(out)
    for r in recs:
        assert r["save"]["layout"] == f"{dt} + fsdp2-ws4", r["save"]
        name = f"rank-{r['rank']:05d}-of-00004.reshard"
        assert r["save"]["files"] == [f"{dt}/{name}", f"fsdp2-ws4/{name}", f"{dt}/optim/{name}",
                                      f"fsdp2-ws4/optim/{name}"], r["save"]
        assert r["load"]["layout"] == f"{dt} + fsdp2-ws4", r["load"]
        assert r["restored"] == r["state_params"] == 21, r
        assert r["param_differ"] == [], r["param_differ"]
        assert r["buffer_differ"] == [], r["buffer_differ"]
        assert r["state_differ"] == [], r["state_differ"]
        assert r["lr"] == 3e-3  # the saved hyper-parameters, not the fresh optimizer's
        assert r["resumed"] == r["uninterrupted"], (r["resumed"], r["uninterrupted"])
        assert r["after_differ"] == [], r["after_differ"]
        assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0], r["losses"]
        # Experts placed otherwise: refused by name, before the optimizer's state is touched.
        msg = r["shard1"]
        assert msg.startswith("LayoutMismatchError") and "model.layers.0.mlp.experts.gate_up_proj" in msg, msg
        assert "['_S(0,2)', 'S(0)']" in msg and "['S(0)', 'S(1)']" in msg and "reshard inspect" in msg, msg
        assert r["shard1_state"] == 0
    assert len({r["uninterrupted"] for r in recs}) == 1
    # What each layout holds: the experts in the DTensor layout, the rest in fsdp2-ws4; the state likewise.
    for r in range(4):
        name = f"rank-{r:05d}-of-00004.reshard"
        f_dt = reshard.engine.open_rank_file(str(out / dt / name))
        f_fs = reshard.engine.open_rank_file(str(out / "fsdp2-ws4" / name))
        assert {t.name for t in f_dt.tensors} == EXPERTS
        # the persistent buffer (the worker's) once, whole, with the dense parameters
        assert {t.name for t in f_fs.tensors} == set(params) - EXPERTS | {"model.rotary_emb.inv_freq"}
        rope = next(t for t in f_fs.tensors if t.name == "model.rotary_emb.inv_freq")
        assert rope.shard is None and rope.local_shape == rope.global_shape == [4], rope
        assert all(t.placements == ["_S(0,2)", "S(0)"] for t in f_dt.tensors), [t.placements for t in f_dt.tensors]
        o_dt = reshard.engine.open_rank_file(str(out / dt / "optim" / name))
        assert {t.name.split("#")[0] for t in o_dt.tensors} == EXPERTS
    m_dt = json.load(open(out / dt / "optim" / "optimizer.json"))
    m_fs = json.load(open(out / "fsdp2-ws4" / "optim" / "optimizer.json"))
    assert set(m_dt["state"]) == EXPERTS and set(m_fs["state"]) == set(params) - EXPERTS
    assert m_dt["parts"] == m_fs["parts"] == [dt, "fsdp2-ws4"]
    assert m_dt["layout"] == dt and m_fs["layout"] == "fsdp2-ws4" and m_dt["step"] == m_fs["step"] == 3
    assert not glob.glob(str(out / ".reshard-commit-*"))


def test_ep_save_verify_and_export(saved, cli, tmp_path):
    out, _, params = saved
    _, dt = _layouts(out)
    v = cli("verify", out, rc=0)
    assert v.out.startswith("OK"), v.text
    r = cli("export", out, "-o", tmp_path / "all", rc=3)
    assert dt in r.text and "fsdp2-ws4" in r.text and "--layout" in r.text, r.text
    from safetensors.torch import load_file

    got = {}
    for key in (dt, "fsdp2-ws4"):
        cli("export", out, "-o", tmp_path / key, "--layout", key, rc=0)
        part = load_file(str(tmp_path / key / "model.safetensors"))
        want = EXPERTS if key == dt else set(params) - EXPERTS | {"model.rotary_emb.inv_freq"}
        assert set(part) == want, (key, sorted(part))
        part.pop("model.rotary_emb.inv_freq", None)
        got.update(part)
    assert set(got) == set(params)
    for n, t in params.items():
        assert t.dtype == got[n].dtype and torch.equal(t.view(-1).view(torch.uint8), got[n].view(-1).view(torch.uint8)), n


def test_ep_save_parts_are_not_taken_for_the_model(saved, cli, tmp_path):
    """Neither part alone is the model: `reshard relayout` refuses them (naming the parts and
    what to do instead) rather than failing on a missing tensor; `inspect` says what they are;
    a load looking for another layout to read from passes them over."""
    from reshard.sources import other_layout

    out, _, _ = saved
    manifest, dt = _layouts(out)
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    for args in ((), ("--from", "fsdp2-ws4"), ("--from", dt)):
        r = cli("relayout", copy, "--world-size", 2, *args, rc=3)
        assert "part of the model only" in r.text and f"{dt} + fsdp2-ws4" in r.text, r.text
        assert "reshard.load_optimizer" in r.text, r.text
    assert sorted(os.listdir(copy)) == sorted(os.listdir(out))  # nothing written
    i = cli("inspect", copy, rc=0)
    assert i.out.count(f"part of the model only (an expert-parallel save): its parts are {dt} fsdp2-ws4") == 2, i.out
    assert other_layout(manifest, 2, "keep") is None
    # A plain FSDP2 job of 4 ranks finds fsdp2-ws4, the dense part: told what it is, not to convert.
    torchrun(4, os.path.join(HERE, "fsdp_worker.py"), "--src", out.parent / "src", "--out", out, "--result",
             tmp_path, "--expect-error", f"Layout fsdp2-ws4 of {out} is one part of an expert-parallel save "
             f"({dt} + fsdp2-ws4)", timeout=300)
    # A manifest whose parts disagree is refused by every reader, naming the field.
    bad = json.load(open(copy / "reshard.json"))
    bad["layouts"]["fsdp2-ws4"]["parts"] = [dt, "fsdp2-ws8"]
    (copy / "reshard.json").write_text(json.dumps(bad))
    r = cli("verify", copy, rc=None)
    assert r.rc != 0 and 'layouts["fsdp2-ws4"].parts' in r.text, r.text


def test_two_layouts_commit_together(saved, tmp_path):
    """A save of two layouts is committed by one rename: with a rank file of the second layout
    missing, the commit fails and OUT has no reshard.json (no half-visible checkpoint)."""
    from reshard.save import _commit_layouts, _Part

    out, recs, _ = saved
    manifest, dt = _layouts(out)
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    os.remove(copy / "reshard.json")
    plan = manifest["layouts"][dt]["plan"]
    native = (["efsdp", "ep"], [2, 2], plan["name"], int(plan["xxh3"], 16))
    parts = [_Part(dt, 4, 0, [], None, {}, dict(fsdp1=None, dtensor=native)),
             _Part("fsdp2-ws4", 4, 0, [], None, {}, dict(fsdp1=None, dtensor=None))]
    save_id, aux = int(recs[0]["save"]["save_id"], 16), manifest["aux_files"]
    victim = copy / "fsdp2-ws4" / "rank-00003-of-00004.reshard"
    os.rename(victim, tmp_path / "aside")
    with pytest.raises(reshard.ReshardError, match="rank-00003|rank 3|missing"):
        _commit_layouts(str(copy), parts, save_id, 3, aux)
    assert not (copy / "reshard.json").exists()
    assert not glob.glob(str(copy / ".reshard-commit-*"))
    os.rename(tmp_path / "aside", victim)
    _commit_layouts(str(copy), parts, save_id, 3, aux)
    again = json.load(open(copy / "reshard.json"))
    assert again["layouts"] == manifest["layouts"] and again["source"] == manifest["source"]
