"""Expert parallel with the experts fully_shard'ed on tensor dim 1 (issue 22): torchtitan's
apply_fsdp passes shard_placement_fn=lambda p: Shard(1) for the routed experts when efsdp x ep
exceeds the number of experts (dim 0 would leave ranks empty or uneven shards), and so does
reshard.ep.parallelize. A tiny Mixtral of 2 experts on 4 gloo processes (ep=2, efsdp=2:
tests/python/ep_dim1_worker.py): torch records the experts as [S(1), S(0)] on (efsdp, ep).

* python -m reshard.ep --world-size 4 --ep 2 writes the plan of that job (the experts' rules
  "fsdp_dim": 1); reshard convert with it gives the DTensor layout the job reads as stored;
* loaded from that layout (+ fsdp2-ws4), from another layout (the experts on dim 0, resharded
  while reading) and from the Hugging Face checkpoint directly: bit-equal to from_pretrained;
* reshard.save + reshard.load + reshard.load_optimizer: every parameter and state tensor back
  bit for bit;
* a save of the same model with the experts on dim 0 is refused by the dim-1 job's load and
  load_optimizer, naming the parameter and both placements."""

import glob
import json
import os
import shutil

import pytest

import reshard

from dist_util import HERE, torchrun
from dtensor_common import tiny_mixtral

WORKER = os.path.join(HERE, "ep_dim1_worker.py")
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def test_experts_shard_dim_follows_torchtitan():
    from reshard.ep import experts_shard_dim

    assert experts_shard_dim(8, 8, 2) == 1   # Mixtral, 16 GPUs, ep=2: efsdp 8
    assert experts_shard_dim(8, 4, 2) == 0   # efsdp x ep == experts: dim 0, as before
    assert experts_shard_dim(4, 2, 2) == 0
    assert experts_shard_dim(2, 2, 2) == 1
    assert experts_shard_dim(2, 2, 2, experts_fsdp_dim=0) == 0
    assert experts_shard_dim(8, 1, 2, experts_fsdp_dim=1) == 1
    with pytest.raises(ValueError, match="experts_fsdp_dim 2"):
        experts_shard_dim(8, 1, 2, experts_fsdp_dim=2)


@pytest.fixture(scope="module")
def moe2(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe2")
    tiny_mixtral(d / "src", num_local_experts=2)
    return d


def test_plan_cli_writes_the_jobs_expert_rules(moe2, tmp_path, capsys):
    from reshard import ep

    src = str(moe2 / "src")
    assert ep.main([src, "-o", str(tmp_path / "a.json"), "--world-size", "4", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor dim 1 (torchtitan's rule for efsdp=2 x ep=2)" in out, out
    plan = json.loads((tmp_path / "a.json").read_text())
    assert plan["fsdp"] == {"mesh_dim": "efsdp"}
    assert [r.get("fsdp_dim") for r in plan["rules"]] == [1, 1], plan
    # Sizes where efsdp x ep <= experts, or no sizes: dim 0, the plan as before (no fsdp_dim).
    for extra in (["--world-size", "2", "--ep", "2"], []):
        assert ep.main([src, "-o", str(tmp_path / "b.json"), *extra]) == 0
        plan = json.loads((tmp_path / "b.json").read_text())
        assert all("fsdp_dim" not in r for r in plan["rules"]), plan
    assert "no --world-size / --ep given" in capsys.readouterr().out
    assert ep.main([src, "-o", str(tmp_path / "c.json"), "--experts-fsdp-dim", "1"]) == 0
    assert [r.get("fsdp_dim") for r in json.loads((tmp_path / "c.json").read_text())["rules"]] == [1, 1]
    for bad, why in ((["--world-size", "4"], "go together"), (["--world-size", "3", "--ep", "2"], "multiple")):
        with pytest.raises(SystemExit):
            ep.main([src, "-o", str(tmp_path / "d.json"), *bad])
        assert why in capsys.readouterr().err
    # FSDP2 shards dim 1 evenly only: refused by name (gate_up_proj's dim 1 is 32, down_proj's 32).
    from reshard.errors import UnsupportedError
    from reshard.model import empty_model

    with pytest.raises(UnsupportedError, match=r"gate_up_proj \[2, 32, 32\].*efsdp=3.*not a multiple of 3"):
        ep.capture_plan(empty_model(src), "x", efsdp=3, ep=2)


def test_expert_parallel_dim1_job_loads_saves_and_resumes_exactly(moe2, cli, tmp_path):
    from reshard import ep, model_manifest

    src = moe2 / "src"
    out, other, save, save0, result = (tmp_path / n for n in ("out", "other", "save", "save0", "result"))
    result.mkdir()
    assert model_manifest.main([str(src), "-o", str(tmp_path / "reshard-model.json")]) == 0
    assert ep.main([str(src), "-o", str(tmp_path / "mixtral_ep.json"), "--world-size", "4", "--ep", "2"]) == 0
    assert ep.main([str(src), "-o", str(tmp_path / "dim0.json"), "--name", "dim0", "--experts-fsdp-dim", "0"]) == 0
    for o, plan in ((out, "mixtral_ep"), (other, "dim0")):
        o.mkdir()
        shutil.copy(tmp_path / "reshard-model.json", o / "reshard-model.json")
        cli("convert", src, "-o", o, "--mesh", "efsdp=2,ep=2", "--plan", tmp_path / f"{plan}.json", rc=0)
    cli("convert", src, "-o", out, "--world-size", "4", rc=0)
    assert cli("verify", out, rc=0).out.startswith("OK")
    torchrun(4, WORKER, result, src, f"out={out}", f"other={other}", f"hf={src}", "--", save, save0, timeout=400)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(result / "rank-*.json")))]
    assert len(recs) == 4
    for r in recs:
        loads = r["loads"]
        for label, rec in loads.items():
            assert rec["differ"] == [], (label, rec)
        # torch's placements: fully_shard's Shard(1) on efsdp, EP's Shard(0) on ep; half of the
        # rank's one expert's rows of dim 1.
        assert r["placements"][GATE_UP] == ["S(1)", "S(0)"], r["placements"]
        assert r["placements"]["model.layers.1.mlp.experts.down_proj"] == ["S(1)", "S(0)"]
        assert r["placements"]["model.norm.weight"] == ["S(0)"]
        assert r["local_shapes"][GATE_UP] == [1, 16, 32], r["local_shapes"]
        # OUT: the layout of the plan reshard.ep wrote, read as stored, + fsdp2-ws4.
        assert loads["out"]["layout"].startswith("dtensor-efsdp2.ep2-mixtral_ep."), loads["out"]
        assert loads["out"]["layout"].endswith(" + fsdp2-ws4") and "resharded" not in loads["out"]["source"], \
            loads["out"]
        # The experts on dim 0 in OTHER: planned for this job and resharded while reading.
        assert loads["other"]["layout"].startswith("dtensor-efsdp2.ep2-live."), loads["other"]
        assert "resharded while reading to mesh efsdp=2,ep=2" in loads["other"]["source"], loads["other"]
        assert loads["hf"]["source"].count("through transformers' conversion") == 2, loads["hf"]
        # Save -> load -> load_optimizer: bit for bit.
        assert r["save"]["layout"].startswith("dtensor-efsdp2.ep2-saved.") and \
            r["save"]["layout"].endswith(" + fsdp2-ws4"), r["save"]
        assert r["reload"]["layout"] == r["save"]["layout"], r["reload"]
        assert r["restored"] == r["state_params"] == 21, r
        assert r["param_differ"] == [] and r["state_differ"] == [], (r["param_differ"], r["state_differ"])
        assert len(r["losses"]) == 2 and all(x == x for x in r["losses"]), r["losses"]
        # The dim-0 job's save: refused by name and both placements, nothing loaded.
        assert r["placements0"] == ["_S(0, 2)", "S(0)"], r["placements0"]
        msg = r["dim0_load"]
        assert msg.startswith("LayoutMismatchError") and GATE_UP in msg, msg
        assert "['S(1)', 'S(0)']" in msg and "['_S(0,2)', 'S(0)']" in msg, msg
        msg = r["dim0_optim"]
        assert msg.startswith("LayoutMismatchError") and GATE_UP in msg, msg
        assert "['S(1)', 'S(0)']" in msg and "['_S(0,2)', 'S(0)']" in msg, msg
        assert r["dim0_optim_state"] == 0
    # The saved plan: fsdp.dim 0 for the job, the experts' rules "fsdp_dim": 1.
    manifest = json.load(open(save / "reshard.json"))
    (key,) = [k for k in manifest["layouts"] if k.startswith("dtensor-")]
    header = json.loads(reshard._C.RankFile.open(
        str(save / key / "rank-00000-of-00004.reshard")).header_json())
    assert {e["name"]: e["placements"] for e in header["tensors"]}[GATE_UP] == ["S(1)", "S(0)"]
