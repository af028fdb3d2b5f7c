"""FP8 block-scaled checkpoints (DeepSeek-V3 / Qwen3-FP8 hub format: float8_e4m3fn weights with
a float32 weight_scale_inv per 128x128 block; a tiny DeepSeek-V3 from fp8_checkpoint.py), both
policies (formats/model-manifest.md, "quantization"):

* dequantize (what `reshard convert` captures by default, and what from_pretrained does on a
  machine without a GPU): convert -> FSDP2 load at world sizes 2 and 3 (rows cut inside a
  128-row scale block) -> every parameter, buffer and the logits bit-equal to transformers'
  own from_pretrained (fsdp_worker.py); `verify --source` passes; --dtype fp32 gives
  from_pretrained(dtype=float32)'s products, rounded once;
* keep: the rank files hold each FP8 weight and its scale as the FP8 model (FP8Linear,
  FP8Experts) has them, each sharded by its own dim-0 rule: read back with the independent
  reference reader and compared element for element with the checkpoint (experts stacked and
  concatenated as transformers does); --dtype bf16 on it is refused; on a GPU
  (test_gpu_keep_policy_loads_the_live_fp8_model) reshard.load into the FP8 model equals
  from_pretrained's;
* refused by name: a weight without its scale, a scale grid transformers would apply with a
  block other than the checkpoint's, and quantization methods other than fp8 (MXFP4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from dist_util import torchrun as _torchrun

import fp8_checkpoint
import reference_reader as rf

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = {"RESHARD_MODEL_CAPTURE": "1", "RESHARD_PYTHON": sys.executable}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fp8") / "deepseek_v3_fp8")
    tensors = fp8_checkpoint.write(path)
    return path, tensors


def _from_pretrained(src, dtype):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)


def _capture(src, out_file, policy):
    subprocess.run([sys.executable, "-m", "reshard.model_manifest", src, "-o", str(out_file), "--quantized", policy],
                   check=True, capture_output=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    return json.load(open(out_file))


def _gather(out, ws, name):
    """The full tensor `name` from the rank files of fsdp2-ws`ws` (reference reader): each
    rank's rows [start, end) of dim 0 by FSDP2's chunk rule, or whole on every rank."""
    files = rf.layout_rank_files(os.path.join(out, f"fsdp2-ws{ws}"))
    opened = [rf.RankFile.open(files[r]) for r in range(ws)]
    entries = [f.entry(name) for f in opened]
    if entries[0].shard is None:
        return opened[0].read_tensor(name)
    for r, e in enumerate(entries):
        assert (e.shard.dim, e.shard.start, e.shard.end) == (0, *rf.chunk_rows(e.global_shape[0], ws, r)), name
    return torch.cat([f.read_tensor(name) for f in opened], 0)


def test_dequantize_policy_is_bit_exact_against_from_pretrained(fp8_src, cli, tmp_path):
    src, _ = fp8_src
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", 2, rc=0, env=CAPTURE)
    assert "capturing the model manifest" in r.err
    conv = json.load(open(out / "reshard-model.json"))["conversion"]
    assert conv["quantization"] == {"method": "fp8", "policy": "dequantize", "weight_block_size": [128, 128]}
    assert not conv["refused"]
    ops = json.dumps(conv["targets"])
    # attention (5) x 2 layers, dense MLP (3), shared experts (3), 4 routed experts x 3
    assert ops.count('"dequant_fp8"') == 5 * 2 + 3 + 3 + 4 * 3, "every FP8 weight is dequantized"
    cli("convert", src, "-o", out, "--world-size", 3, rc=0)
    r = cli("verify", out, "--source", src, rc=0)
    assert "OK" in r.out
    r = cli("export", out, "-o", tmp_path / "hub", "--hub-names", "--layout", "fsdp2-ws3")
    assert r.rc != 0 and "dequantized from FP8 weight" in r.text, r  # no FP8 names to write back
    r = cli("export", out, "-o", tmp_path / "exported", "--layout", "fsdp2-ws3", rc=0)
    # The weights are plain bf16 now: the fp8 quantization_config goes (with it, transformers
    # would build FP8Linear layers on a GPU and quantize them again); the rest of config.json stays.
    assert "quantization_config removed" in r.out, r.out
    src_config = json.load(open(os.path.join(src, "config.json")))
    exp_config = json.load(open(tmp_path / "exported" / "config.json"))
    assert src_config["quantization_config"]["quant_method"] == "fp8"
    assert exp_config == {k: v for k, v in src_config.items() if k != "quantization_config"}
    exported = _from_pretrained(str(tmp_path / "exported"), torch.bfloat16).state_dict()
    ref = _from_pretrained(src, torch.bfloat16).state_dict()
    assert set(exported) == set(ref)
    for name, v in ref.items():
        assert torch.equal(_bits(exported[name]), _bits(v)), f"{name}: from_pretrained(export) differs"
    for ws in (2, 3):
        os.makedirs(tmp_path / f"r{ws}")
        _torchrun(ws, os.path.join(HERE, "fsdp_worker.py"), "--src", src, "--out", out,
                  "--result", tmp_path / f"r{ws}", "--steps", 0)
    # FSDP1 at 2: flat shards of dequantized weights equal FSDP1's own of from_pretrained's model.
    from test_mxfp4 import fsdp1_ranks

    fsdp1_ranks(2, src, out, tmp_path)
    # --dtype fp32: the float32 products themselves (from_pretrained(dtype=float32)), not
    # bf16 widened; read back with the reference reader.
    out32 = tmp_path / "out32"
    cli("convert", src, "-o", out32, "--world-size", 1, "--dtype", "fp32", "--model-manifest",
        out / "reshard-model.json", rc=0)
    ref = _from_pretrained(src, torch.float32).state_dict()
    files = rf.layout_rank_files(out32 / "fsdp2-ws1-fp32")
    names = set(rf.RankFile.open(files[0]).names())
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"):
        assert name in names
        got = rf.read_tensor(files[0], name)
        assert got.dtype == torch.float32 and torch.equal(_bits(got), _bits(ref[name])), name


def test_keep_policy_stores_each_fp8_weight_with_its_scale(fp8_src, cli, tmp_path):
    src, tensors = fp8_src
    manifest = _capture(src, tmp_path / "keep.json", "keep")
    assert manifest["conversion"]["quantization"]["policy"] == "keep"
    names = {n for p in manifest["params"] for n in p["names"]}
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in names  # the FP8 model's parameters
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in names
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", 3, "--model-manifest", tmp_path / "keep.json", "--dtype", "bf16")
    assert r.rc != 0 and "quantization policy keep" in r.text and "--dtype keep" in r.text, r
    cli("convert", src, "-o", out, "--world-size", 3, "--model-manifest", tmp_path / "keep.json", rc=0)
    # The same in one command: convert captures the manifest with the policy it is given.
    one = tmp_path / "one"
    cli("convert", src, "-o", one, "--world-size", 3, "--quantized", "keep", env=CAPTURE, rc=0, timeout=600)
    assert json.load(open(one / "reshard-model.json"))["conversion"]["quantization"]["policy"] == "keep"
    assert [f.read_bytes() for f in sorted((one / "fsdp2-ws3").iterdir())] == \
        [f.read_bytes() for f in sorted((out / "fsdp2-ws3").iterdir())]

    def expert(layer, proj, suffix, e):
        return tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"]

    want = {}
    for suffix, model_suffix in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
        stacked = {p: torch.stack([expert(1, p, suffix, e) for e in range(4)]) for p in ("gate_proj", "up_proj", "down_proj")}
        want[f"model.layers.1.mlp.experts.gate_up_proj{model_suffix}"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1)
        want[f"model.layers.1.mlp.experts.down_proj{model_suffix}"] = stacked["down_proj"]
    for k, v in tensors.items():
        if ".experts." not in k:
            want[k] = v
    files = rf.layout_rank_files(out / "fsdp2-ws3")
    assert set(rf.RankFile.open(files[0]).names()) == set(want)
    n_fp8 = 0
    for name, v in want.items():
        got = _gather(out, 3, name)
        assert got.dtype == v.dtype and got.shape == v.shape, (name, got.dtype, v.dtype, got.shape, v.shape)
        assert torch.equal(_bits(got), _bits(v)), f"{name} differs from the checkpoint"
        n_fp8 += v.dtype == torch.float8_e4m3fn
    assert n_fp8 == 2 * 5 + 3 + 3 + 2  # attention x2, dense MLP, shared experts, fused experts
    # The entries are the live FP8 model's parameters (built empty by transformers' own
    # quantizer, as from_pretrained builds it on a GPU): names, global shapes and dtypes.
    import reshard
    from reshard.conversion import quantizer_for

    live = reshard.empty_model(src)
    quantizer_for(live.config, "keep")._process_model_before_weight_loading(live)
    state = dict(live.named_parameters())
    state.update({n: b for n, b in live.named_buffers() if n in live.state_dict()})
    first = rf.RankFile.open(files[0])
    assert set(state) == set(first.names())
    for name, p in state.items():
        e = first.entry(name)
        assert list(p.shape) == e.global_shape, (name, list(p.shape), e.global_shape)
        if isinstance(p, torch.nn.Parameter):  # buffers: the loader casts to the live dtype
            assert p.dtype == rf.torch_dtype(e.dtype), (name, p.dtype, e.dtype)
    # Each scale is a parameter of its own, sharded by its own rows: o_proj's [2, 1] scale has
    # one row on ranks 0 and 1 while its weight's 256 rows are cut at 86 and 172.
    o = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    assert [rf.read_tensor(files[r], o).shape[0] for r in range(3)] == [1, 1, 0]
    r = cli("verify", out, "--source", src, rc=0)
    assert "OK" in r.out
    # Exported as stored (FP8 weights and their scales): the quantization_config stays.
    r = cli("export", out, "-o", tmp_path / "exported", "--layout", "fsdp2-ws3", rc=0)
    assert "removed" not in r.out
    assert json.load(open(tmp_path / "exported" / "config.json")) == json.load(open(os.path.join(src, "config.json")))


def test_a_weight_without_its_scale_is_refused_by_name(cli, tmp_path):
    src = str(tmp_path / "src")
    dropped = "model.layers.0.self_attn.o_proj.weight"
    fp8_checkpoint.write(src, drop_scale=dropped)
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", 2, env=CAPTURE)
    assert r.rc != 0, r
    assert f'F8_E4M3 tensor "{dropped}" is not dequantized' in r.text, r
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in r.text and "never stored without its scale" in r.text


def test_a_grid_transformers_would_apply_with_another_block_is_refused(cli, tmp_path):
    # intermediate_size 192: scale grid [2, 2] of a [192, 256] weight; transformers derives
    # 96-row blocks from it (rows // scale_rows) where the checkpoint has 128-row ones.
    src = str(tmp_path / "src")
    fp8_checkpoint.write(src, cfg=fp8_checkpoint.config(intermediate_size=192))
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", 2, env=CAPTURE)
    assert r.rc != 0, r
    assert "model.layers.0.mlp.gate_proj.weight" in r.text and "derives a 96x128 block" in r.text, r
    assert "weight_block_size is 128x128" in r.text


@pytest.mark.gpu
def test_gpu_keep_policy_loads_the_live_fp8_model(fp8_src, tmp_path):
    """On CUDA: from_pretrained keeps the FP8 model (FP8Linear / FP8Experts); reshard.load of
    the keep-policy rank files into that model, built empty by transformers' own quantizer,
    gives the same parameters bit for bit (world size 1: FSDP2 over one GPU)."""
    assert torch.cuda.is_available(), "GPU test selected on a machine without CUDA"
    src, _ = fp8_src
    out = tmp_path / "out"
    _capture(src, tmp_path / "keep.json", "keep")
    bin_ = os.environ.get("RESHARD_BIN", "/work/main/build/reshard")
    subprocess.run([bin_, "convert", src, "-o", str(out), "--world-size", "1", "--model-manifest",
                    str(tmp_path / "keep.json")], check=True)
    _torchrun(1, os.path.join(HERE, "fp8_keep_worker.py"), "--src", src, "--out", out, "--manifest",
              tmp_path / "keep.json")


def test_other_quantization_methods_are_refused_by_name():
    """Every quant_method but fp8 and mxfp4 (test_mxfp4.py): refused at capture, naming it
    (convert refuses a manifest with any refusal); fp8 / mxfp4 without the quantizer (a capture
    not made by reshard.model_manifest) name the way they are captured."""
    import transformers as tr

    from reshard.conversion import capture_conversion

    for method, why in (("awq", "not supported"), ("mxfp4", "policy (--quantized)")):
        cfg = fp8_checkpoint.config(num_hidden_layers=1)
        cfg.quantization_config = {"quant_method": method}
        with torch.device("meta"):
            model = tr.DeepseekV3ForCausalLM(cfg)
        plan = capture_conversion(model, [("model.norm.weight", "BF16", [256])])
        assert plan["targets"] == [] and len(plan["refused"]) == 1
        assert f"quant_method {method!r}" in plan["refused"][0] and why in plan["refused"][0], plan
