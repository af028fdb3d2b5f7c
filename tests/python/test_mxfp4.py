"""MXFP4 checkpoints (gpt-oss hub format: each expert projection as U8 `_blocks` of 32 FP4 e2m1
values and U8 E8M0 `_scales`; a tiny gpt-oss from mxfp4_checkpoint.py). Policy dequantize, the
only one (formats/model-manifest.md, "quantization"): what from_pretrained does without Triton
kernels (this machine; `Mxfp4Config(dequantize=True)` on a GPU, the fine-tuning recipe), each
projection dequantized to bfloat16 and transposed to the model's [experts, in, out]:

* convert -> FSDP2 load at world sizes 2 and 3 (experts split 2/2 and 2/1/1) -> every
  parameter, buffer and the logits bit-equal to from_pretrained (fsdp_worker.py); `verify
  --source` passes; export drops config.json's quantization_config and loads back equal;
* blocks with exponents across E8M0's range (2^-127 ... 2^92, subnormal bfloat16 results
  included) equal an independent decoding written here (not transformers') and from_pretrained;
* refused by name: policy keep, a quantized checkpoint converted without the captured
  conversion, blocks without their scales.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from dist_util import torchrun as _torchrun

import mxfp4_checkpoint
import reference_reader as rf

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = {"RESHARD_MODEL_CAPTURE": "1", "RESHARD_PYTHON": sys.executable}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def _from_pretrained(src, dtype=torch.bfloat16):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)


def _gather(out, ws, name):
    files = rf.layout_rank_files(os.path.join(out, f"fsdp2-ws{ws}"))
    opened = [rf.RankFile.open(files[r]) for r in range(ws)]
    entries = [f.entry(name) for f in opened]
    for r, e in enumerate(entries):
        assert (e.shard.dim, e.shard.start, e.shard.end) == (0, *rf.chunk_rows(e.global_shape[0], ws, r)), name
    return torch.cat([f.read_tensor(name) for f in opened], 0)


def independent_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The MXFP4 format's values, decoded here: code j of block (e, r, g) (byte j // 2, low
    nibble first) times 2^(scale - 127), exact in float64, rounded once to bfloat16, laid out
    [E, in, out] as gpt-oss's experts hold them."""
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    codes = torch.stack([lo, hi], -1).reshape(*blocks.shape[:-1], 32)  # [E, N, G, 32]
    mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    vals = mag[codes % 8] * torch.where(codes >= 8, -1.0, 1.0).to(torch.float64)
    vals = vals * torch.pow(torch.tensor(2.0, dtype=torch.float64), scales.to(torch.float64) - 127).unsqueeze(-1)
    e, n, g, _ = vals.shape
    return vals.reshape(e, n, g * 32).transpose(1, 2).to(torch.bfloat16).contiguous()


def fsdp1_ranks(ws, src, out, tmp_path):
    """convert --layout fsdp1 (the model manifest already in OUT), then fsdp1_worker.py."""
    import glob
    import subprocess

    bin_ = os.environ.get("RESHARD_BIN", os.path.join(HERE, "..", "..", "build", "reshard"))
    subprocess.run([bin_, "convert", src, "-o", str(out), "--world-size", str(ws), "--layout", "fsdp1"],
                   check=True, capture_output=True)
    result = tmp_path / f"fsdp1-{ws}"
    _torchrun(ws, os.path.join(HERE, "fsdp1_worker.py"), "--src", src, "--out", out, "--result", result,
              "--steps", 0)
    results = [json.load(open(p)) for p in sorted(glob.glob(f"{result}.*"))]
    assert len(results) == ws and all(r["ok"] for r in results), results
    return results


@pytest.fixture(scope="module")
def mx_src(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mxfp4") / "gpt_oss_mxfp4")
    return path, mxfp4_checkpoint.write(path)


def test_dequantize_is_bit_exact_against_from_pretrained(mx_src, cli, tmp_path):
    src, _ = mx_src
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", 2, rc=0, env=CAPTURE)
    conv = json.load(open(out / "reshard-model.json"))["conversion"]
    assert conv["quantization"] == {"method": "mxfp4", "policy": "dequantize", "weight_block_size": []}
    assert not conv["refused"]
    nodes = {t["name"]: t["expr"] for t in conv["targets"] if t["expr"]["op"] == "dequant_mxfp4"}
    assert sorted(nodes) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                   for p in ("gate_up_proj", "down_proj"))
    g = nodes["model.layers.0.mlp.experts.gate_up_proj"]
    assert [o["key"] for o in g["of"]] == ["model.layers.0.mlp.experts.gate_up_proj_blocks",
                                           "model.layers.0.mlp.experts.gate_up_proj_scales"]
    cli("convert", src, "-o", out, "--world-size", 3, rc=0)
    r = cli("verify", out, "--source", src, rc=0)
    assert "OK" in r.out
    for ws in (2, 3):
        os.makedirs(tmp_path / f"r{ws}")
        _torchrun(ws, os.path.join(HERE, "fsdp_worker.py"), "--src", src, "--out", out,
                  "--result", tmp_path / f"r{ws}", "--steps", 0)
    # FSDP1 at 2 (flat shards padded, experts split inside a unit): the local flat shards equal
    # FSDP1's own of from_pretrained's model, summon_full_params gives its parameters.
    fsdp1_ranks(2, src, out, tmp_path)
    r = cli("export", out, "-o", tmp_path / "exported", "--layout", "fsdp2-ws3", rc=0)
    assert "quantization_config removed" in r.out, r.out
    src_config = json.load(open(os.path.join(src, "config.json")))
    assert json.load(open(tmp_path / "exported" / "config.json")) == \
        {k: v for k, v in src_config.items() if k != "quantization_config"}
    exported = _from_pretrained(str(tmp_path / "exported")).state_dict()
    ref = _from_pretrained(src).state_dict()
    assert set(exported) == set(ref)
    for name, v in ref.items():
        assert torch.equal(_bits(exported[name]), _bits(v)), f"{name}: from_pretrained(export) differs"
    r = cli("export", out, "-o", tmp_path / "hub", "--hub-names", "--layout", "fsdp2-ws3")
    assert r.rc != 0 and "dequantized from MXFP4 blocks" in r.text, r


def test_every_exponent_equals_an_independent_decoding(cli, tmp_path):
    src = str(tmp_path / "wide")
    tensors = mxfp4_checkpoint.write(src, wide_exponents=True)
    scales = tensors["model.layers.0.mlp.experts.down_proj_scales"]
    assert int(scales.min()) <= 2 and int(scales.max()) > 200, "the test needs exponents across E8M0's range"
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 3, rc=0, env=CAPTURE)
    ref = _from_pretrained(src).state_dict()
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            want = independent_decode(tensors[key + "_blocks"], tensors[key + "_scales"])
            got = _gather(out, 3, key)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape, (key, got.shape, want.shape)
            assert torch.equal(_bits(got), _bits(want)), f"{key}: differs from the independent decoding"
            assert torch.equal(_bits(got), _bits(ref[key])), f"{key}: differs from from_pretrained"
            if key == "model.layers.0.mlp.experts.down_proj":  # subnormal bfloat16 results were compared
                assert ((want != 0) & (want.float().abs() < 2.0 ** -126)).any()


def test_refusals_name_the_cause(mx_src, cli, tmp_path):
    src, _ = mx_src
    # Converted without the captured conversion (the suite turns capture off by default).
    r = cli("convert", src, "-o", tmp_path / "plain", "--world-size", 2)
    assert r.rc != 0 and 'quant_method "mxfp4"' in r.text and "python -m reshard.model_manifest" in r.text, r
    # Policy keep: no live model holds MXFP4 as FSDP-shardable parameters.
    r = cli("convert", src, "-o", tmp_path / "keep", "--world-size", 2, "--quantized", "keep", env=CAPTURE)
    assert r.rc != 0 and "Triton" in r.text and "dequantize" in r.text, r
    # Blocks without their scales.
    broken = str(tmp_path / "broken")
    mxfp4_checkpoint.write(broken, drop_scales="model.layers.1.mlp.experts.down_proj_scales")
    r = cli("convert", broken, "-o", tmp_path / "b", "--world-size", 2, env=CAPTURE)
    assert r.rc != 0 and "model.layers.1.mlp.experts.down_proj" in r.text, r
