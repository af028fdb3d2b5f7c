"""reshard.load of a DTensor job (issue 22): FSDP2 over tensor parallel on a 2x2 mesh
(dp_shard x tp, 4 gloo processes) and tensor parallel alone on 1x4, loaded from
`reshard convert --mesh ... --plan ...` of checkpoints written by save_pretrained: a Llama
(untied) and a Qwen2 (biases on q/k/v, tie_word_embeddings=True). Plans: a hand-written one,
transformers' own tp plan and torchtitan's Llama plan, both captured by
`python -m reshard.parallel_plan` (`--tp-plan torchtitan`). All cases of one mesh run in one
torchrun (tests/python/dtensor_load_worker.py). Reference: from_pretrained of the same
checkpoint, bit for bit (parameters' full tensors, buffers). From a layout of another plan
alone, reshard.load plans the job's rank over it (bit-exact too). A tie that parallelize_module
split into two parameters is refused before any byte moves, naming both. With the captured
plans, the logits are compared with from_pretrained's within a tolerance (see _check_logits)
and 10 AdamW steps lower the loss; tied names stay one parameter throughout."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from dist_util import HERE, dist_env, torchrun
from dtensor_common import llama_plan

WORKER = os.path.join(HERE, "dtensor_load_worker.py")

PLAN = llama_plan("llama_tp")

MESHES = [("dp_shard=2,tp=2", True), ("tp=4", False)]
TP_PLANS = {"hf": "transformers", "torchtitan": "torchtitan"}


def _configs():
    # Odd vocabularies (uneven TP and FSDP shards of embeddings / head); 4 key-value heads so
    # that tp=4 gives each rank whole heads (a column shard of k_proj must be whole heads).
    llama = transformers.LlamaConfig(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                     tie_word_embeddings=False)
    qwen2 = transformers.Qwen2Config(vocab_size=133, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                     tie_word_embeddings=True)
    return {"llama": (llama, transformers.LlamaForCausalLM), "qwen2": (qwen2, transformers.Qwen2ForCausalLM)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The tiny Llama and Qwen2 written by save_pretrained in bf16."""
    out = {}
    for arch, (cfg, cls) in _configs().items():
        d = tmp_path_factory.mktemp(f"dtensor-{arch}")
        torch.manual_seed(0)
        model = cls(cfg).to(torch.bfloat16)
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        model.save_pretrained(d)
        out[arch] = d
    return out


def _capture(src, plan_file, *extra):
    p = subprocess.run([sys.executable, "-m", "reshard.parallel_plan", str(src), "-o", str(plan_file), *extra],
                       capture_output=True, text=True, env=dist_env(), timeout=300)
    assert p.returncode == 0, p.stderr
    return {r["pattern"]: r["placements"]["tp"] for r in json.loads(plan_file.read_text())["rules"]}


def test_captured_plans(sources, tmp_path):
    """python -m reshard.parallel_plan: transformers' plan (default) and torchtitan's, per model."""
    hf = _capture(sources["llama"], tmp_path / "llama_hf.json", "--fsdp", "dp_shard")
    assert json.loads((tmp_path / "llama_hf.json").read_text())["fsdp"] == {"mesh_dim": "dp_shard"}
    assert hf["model.layers.*.self_attn.q_proj.weight"] == "S(0)"
    assert hf["model.layers.*.self_attn.o_proj.weight"] == "S(1)"
    assert hf["model.layers.*.mlp.down_proj.weight"] == "S(1)"
    assert hf["lm_head.weight"] == "S(0)"
    assert "model.embed_tokens.weight" not in hf  # transformers replicates untied embeddings
    tt = _capture(sources["llama"], tmp_path / "llama_tt.json", "--tp-plan", "torchtitan")
    assert tt == {**hf, "model.embed_tokens.weight": "S(0)"}  # tok_embeddings: RowwiseParallel
    assert not any("norm" in k for k in tt), tt  # SequenceParallel: norms' weights replicated
    for style in ("transformers", "torchtitan"):
        q = _capture(sources["qwen2"], tmp_path / f"qwen2_{style}.json", "--tp-plan", style)
        # Biases of column-wise projections shard with their rows; o_proj has none.
        assert q["model.layers.*.self_attn.k_proj.bias"] == "S(0)", q
        assert "model.layers.*.self_attn.o_proj.bias" not in q
        # The tie: one parameter, one placement (vocab) under both names.
        assert q["model.embed_tokens.weight"] == q["lm_head.weight"] == "S(0)", q


def test_tied_names_get_one_placement_or_are_refused():
    """A plan placing only one name of a tie gives the other that placement; a plan placing the
    two names differently is refused, naming both."""
    from reshard.parallel_plan import capture_plan

    cfg, cls = _configs()["qwen2"]
    with torch.device("meta"):
        model = cls(cfg)
    # transformers keeps the plan in the config (base model's names) and, merged, in the
    # model's _tp_plan (full names): take the embeddings out of both, then make them colwise.
    def set_embed(style):
        for plan, key in ((model.config.base_model_tp_plan, "embed_tokens"), (model._tp_plan, "model.embed_tokens")):
            plan.pop(key, None)
            if style:
                plan[key] = style

    set_embed(None)
    rules = {r["pattern"]: r["placements"]["tp"] for r in capture_plan(model, "q")["rules"]}
    assert rules["model.embed_tokens.weight"] == rules["lm_head.weight"] == "S(0)", rules
    set_embed("colwise")  # an Embedding column-wise: S(1), lm_head S(0)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*lm_head\.weight|lm_head\.weight.*"
                                         r"model\.embed_tokens\.weight"):
        capture_plan(model, "q")


def _check_logits(r, what):
    # TP computes the same sums in another order: o_proj / down_proj each add tp partial
    # products (all-reduced, or reduce-scattered under sequence parallel) where the reference
    # adds once, each result rounded to bf16, and the head's vocabulary shards are gathered.
    # Each logit is then the reference's up to a few roundings: within 4 bf16 ulps (8 bits of
    # mantissa) of the logits' scale. Measured: 1-2 ulps. Not bit-equal; greedy tokens agree
    # but for near-ties.
    ulp = 2.0 ** (math.floor(math.log2(r["logits_scale"])) - 7)
    assert r["logits_max_abs_diff"] <= 4 * ulp, (what, r["logits_max_abs_diff"], ulp)
    assert r["argmax_agree"] >= 0.9, (what, r)
    losses = r["losses"]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1, (what, losses)


@pytest.mark.parametrize("mesh,fsdp", MESHES)
def test_dtensor_jobs_load_exactly_and_train(sources, cli, tmp_path, mesh, fsdp):
    extra = ["--fsdp", "dp_shard"] if fsdp else []
    plans = tmp_path / "plans"
    plans.mkdir()
    manual = dict(PLAN, fsdp={"mesh_dim": "dp_shard"}) if fsdp else PLAN
    (plans / "llama_tp.json").write_text(json.dumps(manual))
    other = json.loads(json.dumps(manual))
    other["name"] = "rowwise_o"
    other["rules"][1]["placements"] = {"tp": "S(0)"}  # o_proj column-wise: not this job's plan
    (plans / "rowwise_o.json").write_text(json.dumps(other))

    def convert(src, name):
        out = tmp_path / f"out-{name}"
        cli("convert", src, "-o", out, "--mesh", mesh, "--plan", plans / f"{name}.json", rc=0)
        return str(out)

    cases = [{"name": "llama-manual", "src": str(sources["llama"]), "out": convert(sources["llama"], "llama_tp"),
              "other": convert(sources["llama"], "rowwise_o"), "plan": "manual"}]
    for arch in ("llama", "qwen2"):
        for plan, style in TP_PLANS.items():
            name = f"{arch}_{plan}"
            _capture(sources[arch], plans / f"{name}.json", "--tp-plan", style, *extra)
            cases.append({"name": f"{arch}-{plan}", "src": str(sources[arch]), "out": convert(sources[arch], name),
                          "plan": plan, "train": True})
    # transformers' plan of the decoder layers alone: the tie is two plain tensors after
    # to_empty on tp=4 (no fully_shard), one again after reshard.load.
    layers = json.loads((plans / "qwen2_hf.json").read_text())
    layers["name"] = "qwen2_layers"
    layers["rules"] = [r for r in layers["rules"] if r["pattern"].startswith("model.layers.")]
    (plans / "qwen2_layers.json").write_text(json.dumps(layers))
    cases.append({"name": "qwen2-layers", "src": str(sources["qwen2"]), "out": convert(sources["qwen2"], "qwen2_layers"),
                  "plan": "hf-layers"})
    # transformers' plan applied without tying lm_head and embed_tokens again: refused.
    qwen2_hf = next(c["out"] for c in cases if c["name"] == "qwen2-hf")
    cases.append({"name": "qwen2-split-tie", "src": str(sources["qwen2"]), "out": qwen2_hf,
                  "plan": "hf-untied"})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = tmp_path / "result"
    torchrun(4, WORKER, tmp_path / "cases.json", mesh, result, timeout=900)

    def recs(name):
        got = [json.load(open(f)) for f in sorted(glob.glob(str(result / name / "rank-*.json")))]
        assert len(got) == 4, name
        return got

    for r in recs("llama-manual"):
        assert r["differ"] == [] and r["params"] == r["checked"] > 0 and r["bytes"] > 0, r
        assert r["layout"].startswith("dtensor-") and "llama_tp" in r["layout"], r["layout"]
        # Placements as torch made them: TP's Shard on tp, FSDP2's (_Strided)Shard on dp_shard.
        q = r["placements"]["model.layers.0.self_attn.q_proj.weight"]
        o = r["placements"]["model.layers.0.self_attn.o_proj.weight"]
        if fsdp:  # fully_shard over TP's Shard(0): torch records _StridedShard (str "_S(0, 2)")
            assert q == ["_S(0, 2)", "S(0)"] and o == ["S(0)", "S(1)"], (q, o)
        else:
            assert q == ["S(0)"] and o == ["S(1)"], (q, o)
        # Only another plan's layout in OUT_OTHER: this job's rank planned over it, bit-exact.
        other = r["other"]
        assert "error" not in other, other
        assert other["differ"] == [] and "rowwise_o" in other["source"], other
        assert f"mesh {mesh}" in other["source"] and "no conversion stored" in other["source"], other
    for arch in ("llama", "qwen2"):
        for plan in TP_PLANS:
            what = f"{arch}-{plan}"
            for r in recs(what):
                assert "error" not in r, (what, r.get("error"))
                assert r["differ"] == [], (what, r["differ"])
                assert r["params"] == r["checked"] > 0, (what, r)
                assert f"{arch}_{plan}" in r["layout"], (what, r["layout"])
                pl = r["placements"]
                k = pl["model.layers.1.self_attn.k_proj.weight"]
                assert k == (["_S(0, 2)", "S(0)"] if fsdp else ["S(0)"]), (what, k)
                if arch == "qwen2":
                    assert pl["model.layers.1.self_attn.k_proj.bias"] == k, (what, pl)
                    # The tie: one parameter, vocab-sharded, before and after training.
                    assert r["tied"] == [["lm_head.weight", "model.embed_tokens.weight", True]], (what, r["tied"])
                    assert r["tied_after_training"] == [True], what
                    assert pl["model.embed_tokens.weight"] == k, (what, pl)
                elif plan == "torchtitan":
                    assert pl["model.embed_tokens.weight"] == k, (what, pl)  # vocab-parallel
                    assert pl["lm_head.weight"] == k, (what, pl)
                _check_logits(r, what)
    for r in recs("qwen2-layers"):
        assert "error" not in r, r.get("error")
        assert r["differ"] == [] and r["params"] == r["checked"], r
        assert r["tied"] == [["lm_head.weight", "model.embed_tokens.weight", True]], r["tied"]
    for r in recs("qwen2-split-tie"):
        err = r.get("error", "")
        assert err.startswith("LayoutMismatchError"), r
        assert "lm_head.weight" in err and "model.embed_tokens.weight" in err and "tie" in err, err
        assert "reshard.parallel_plan.parallelize" in err, err


def test_a_style_without_one_placement_per_parameter_is_refused_by_name(tmp_path):
    """Mixtral's fused experts are 'packed_colwise' / 'moe_tp_experts' in transformers' plan:
    no DTensor placement of one parameter says that; the capture refuses naming the style.
    torchtitan's Llama plan on a model without Llama's modules is refused naming the module."""
    from reshard.parallel_plan import capture_plan

    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    with pytest.raises(ValueError, match="packed_colwise|moe_tp_experts"):
        capture_plan(model, "mixtral_tp")
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"no module 'model\.embed_tokens'.*--tp-plan transformers"):
        capture_plan(gpt2, "gpt2_tt", tp_plan="torchtitan")


def test_parallelize_refuses_a_tp_size_that_splits_attention_heads():
    """Column-wise q/k/v give each rank heads / tp heads: 2 key-value heads cannot go to 4 ranks
    (torch would fail later inside attention's reshape); refused before anything is placed."""
    from reshard.parallel_plan import parallelize

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)

    class Mesh:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    with pytest.raises(ValueError, match="num_key_value_heads = 2 is not divisible by the tensor-parallel size 4"):
        parallelize(model, Mesh(4))
    assert not any(hasattr(p, "placements") for p in model.parameters())  # nothing placed
