"""Expert parallel (issue 22), as torchtitan arranges it on torch 2.11, 4 gloo processes: a tiny
Mixtral (4 experts, vocab 37: uneven dense shards) written by transformers' save_pretrained in
the hub layout (per-expert w1/w2/w3), its fused experts `Shard(0)` over `ep=2` with FSDP over
`efsdp=2` inside, the dense parameters fully_shard'ed over a 1-D `fsdp=4` mesh of the same
ranks (tests/python/dtensor_moe_worker.py). Loaded, each bit for bit against from_pretrained of
the same checkpoint (every parameter's full tensor, every buffer), from: OUT holding the
DTensor layout of the expert plan (`--mesh efsdp=2,ep=2 --plan mixtral_ep.json`) and the
FSDP2 layout of the dense parameters (`--world-size 4`), both read as stored; OUT of another
plan (experts not on `ep`) + FSDP2 layout; the DTensor layout alone; the Hugging Face
checkpoint itself (the last three resharded while reading, as reshard.load does for any job
without its own layout). Refused before any byte moves, naming both parameters: dense
parameters fully_shard'ed over two different meshes.

Forward: transformers 5.17's eager MixtralExperts indexes its weights by global expert id, so
it cannot run on an ep shard as it is; the worker runs each rank's experts on the tokens routed
to them and sums the shares over `ep` (what transformers' own `grouped_gemm` / `ep_router` /
`moe_tp_experts` EP plan does, with every rank of an ep group given the same batch). The
logits match from_pretrained's within 4 bf16 ulps of their scale (the experts' outputs are
summed in another order; measured: 1 ulp), and 8 AdamW steps lower the loss on every rank."""

import glob
import json
import math
import os
import shutil

import pytest

from dist_util import HERE, torchrun
from dtensor_common import tiny_mixtral

WORKER = os.path.join(HERE, "dtensor_moe_worker.py")

EXPERTS = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]
PLAN = {"format": "reshard.parallel-plan", "format_version": 1, "name": "mixtral_ep",
        "fsdp": {"mesh_dim": "efsdp"},
        "rules": [{"pattern": p, "placements": {"ep": "S(0)"}} for p in EXPERTS]}


@pytest.fixture(scope="module")
def mixtral_src(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-src")
    tiny_mixtral(d)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # The hub layout: one 2-D weight per expert, fused by reshard convert as transformers does.
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys, sorted(keys)[:8]
    assert not any("experts.gate_up_proj" in k for k in keys)
    return d


def test_expert_parallel_job_loads_exactly(mixtral_src, cli, tmp_path):
    (tmp_path / "mixtral_ep.json").write_text(json.dumps(PLAN))
    # Another plan: the experts fully_shard'ed over efsdp only, replicated over ep.
    (tmp_path / "no_ep.json").write_text(json.dumps(dict(PLAN, name="no_ep", rules=[])))
    out, other, nodense, result = (tmp_path / n for n in ("out", "out-other", "out-nodense", "result"))
    result.mkdir()
    # The model manifest (transformers' conversion: per-expert w1/w3 -> gate_up_proj, w2 ->
    # down_proj), captured once here instead of by each convert (RESHARD_MODEL_CAPTURE=0 in tests).
    from reshard import model_manifest

    assert model_manifest.main([str(mixtral_src), "-o", str(tmp_path / "reshard-model.json")]) == 0
    for o, plan in ((out, "mixtral_ep"), (other, "no_ep"), (nodense, "mixtral_ep")):
        o.mkdir()
        shutil.copy(tmp_path / "reshard-model.json", o / "reshard-model.json")
        cli("convert", mixtral_src, "-o", o, "--mesh", "efsdp=2,ep=2", "--plan", tmp_path / f"{plan}.json", rc=0)
    for o in (out, other):
        cli("convert", mixtral_src, "-o", o, "--world-size", "4", rc=0)
    v = cli("verify", out, rc=0)
    assert v.out.startswith("OK"), v.text
    torchrun(4, WORKER, result, mixtral_src, f"out={out}", f"other={other}", f"nodense={nodense}",
             f"hf={mixtral_src}", timeout=300)
    recs = [json.load(open(f)) for f in sorted(glob.glob(str(result / "rank-*.json")))]
    assert len(recs) == 4
    for r in recs:
        loads = r["loads"]
        assert sorted(loads) == ["hf", "nodense", "other", "out"], loads
        for label, rec in loads.items():
            assert rec["differ"] == [], (label, rec)
            assert rec["bytes"] > 0, (label, rec)
        # OUT: this job's DTensor layout (the experts) + the FSDP2 layout (the dense parameters).
        assert loads["out"]["layout"].startswith("dtensor-efsdp2.ep2-mixtral_ep."), loads["out"]
        assert loads["out"]["layout"].endswith(" + fsdp2-ws4"), loads["out"]
        assert "shard {} of 4 on mesh dim fsdp".format(r["rank"]) in loads["out"]["source"], loads["out"]
        # OUT of another plan (experts not on ep) + the FSDP2 layout: the experts planned for this
        # job over a complete layout and resharded while reading, the dense ones from the FSDP2 layout.
        assert loads["other"]["layout"].startswith("dtensor-efsdp2.ep2-live."), loads["other"]
        assert loads["other"]["layout"].endswith(" + fsdp2-ws4"), loads["other"]
        assert "resharded while reading to mesh efsdp=2,ep=2" in loads["other"]["source"], loads["other"]
        # The DTensor layout alone: the dense parameters resharded from it while reading.
        assert loads["nodense"]["layout"].startswith("dtensor-efsdp2.ep2-mixtral_ep."), loads["nodense"]
        assert loads["nodense"]["source"].count("resharded while reading") == 1, loads["nodense"]
        # The Hugging Face checkpoint itself, both parts through transformers' conversion.
        assert loads["hf"]["source"].count("through transformers' conversion") == 2, loads["hf"]
        # torch 2.11's placements: experts on (efsdp, ep), fully_shard's _StridedShard over EP's
        # Shard(0); dense parameters Shard(0) on the 1-D fsdp mesh.
        assert r["meshes"]["model.layers.0.mlp.experts.gate_up_proj"] == ["efsdp", "ep"]
        assert r["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ["_S(0, 2)", "S(0)"]
        assert r["placements"]["model.layers.1.mlp.experts.down_proj"] == ["_S(0, 2)", "S(0)"]
        assert r["meshes"]["model.embed_tokens.weight"] == ["fsdp"]
        assert r["placements"]["model.embed_tokens.weight"] == ["S(0)"]
        assert r["placements"]["model.layers.0.mlp.gate.weight"] == ["S(0)"]
        assert len(r["placements"]) == r["params"]
        # 37 rows over fsdp=4: torch.chunk's 10, 10, 10, 7 (not efsdp then ep: 10, 9, 9, 9).
        assert r["local_rows"]["model.embed_tokens.weight"] == [10, 10, 10, 7][r["rank"]]
        assert r["local_rows"]["model.layers.0.mlp.experts.gate_up_proj"] == 1
        msg = r["split"]
        assert msg.startswith("UnsupportedError") and "model.embed_tokens.weight" in msg, msg
        assert "mesh dims (dp of 4" in msg and "fsdp of 4" in msg, msg
        ulp = 2.0 ** (math.floor(math.log2(r["logits_scale"])) - 7)
        assert r["logits_max_abs_diff"] <= 4 * ulp, (r["logits_max_abs_diff"], ulp)
        assert r["argmax_agree"] >= 0.9, r["argmax_agree"]
        losses = r["losses"]
        assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    # Every rank trained the same replicated batch: the same losses.
    assert all(r["losses"] == recs[0]["losses"] for r in recs), [r["losses"] for r in recs]
