"""The synthetic Llama-shaped bf16 checkpoint shared by the benchmarks (bench_convert.py,
bench_load.py): realistic shapes, seeded random values at the usual scale (0.02·randn for
matrices, 1 + 0.05·randn for RMSNorm weights), several safetensors files written one at a
time, an index and a transformers-compatible config.json. Cached: regenerated only when its
parameters change."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

VOCAB, HIDDEN, INTER, HEADS = 32000, 4096, 11008, 32
GENERATOR_VERSION = 3


def llama_tensors(n_layers: int, kv_heads: int):
    """(name, shape) in the order Hugging Face writes a Llama checkpoint."""
    kv = HIDDEN * kv_heads // HEADS
    t = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    t += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return t


def nbytes(shape) -> int:
    return math.prod(shape) * 2  # bf16


def layers_for(size_gb: float, kv_heads: int) -> int:
    fixed = sum(nbytes(s) for _, s in llama_tensors(0, kv_heads))
    per_layer = sum(nbytes(s) for _, s in llama_tensors(1, kv_heads)) - fixed
    return max(1, int((size_gb * 1e9 - fixed) // per_layer))


def llama_config(n_layers: int, kv_heads: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": n_layers, "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads, "head_dim": HIDDEN // HEADS, "hidden_act": "silu",
        "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "use_cache": True,
    }


def make_checkpoint(d: Path, size_gb: float, *, kv_heads: int, file_gb: float, seed: int = 0,
                    log=lambda msg: None) -> dict:
    """Writes (or reuses) the checkpoint in `d`, one file in memory at a time; returns its
    description (also stored in d/bench-stamp.json)."""
    stamp = d / "bench-stamp.json"
    n_layers = layers_for(size_gb, kv_heads)
    want = {"n_layers": n_layers, "seed": seed, "file_gb": file_gb, "vocab": VOCAB,
            "hidden": HIDDEN, "intermediate": INTER, "heads": HEADS, "kv_heads": kv_heads,
            "generator": GENERATOR_VERSION}
    if stamp.exists():
        got = json.loads(stamp.read_text())
        if got.get("params") == want:
            log(f"checkpoint: reusing {d}")
            return got
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    tensors = llama_tensors(n_layers, kv_heads)
    groups, cur, cur_b = [], [], 0
    for name, shape in tensors:  # greedy split into files of at most file_gb
        if cur and cur_b + nbytes(shape) > file_gb * 1e9:
            groups.append(cur)
            cur, cur_b = [], 0
        cur.append((name, shape))
        cur_b += nbytes(shape)
    groups.append(cur)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    t0 = time.perf_counter()
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {}
        for name, shape in group:
            t = torch.randn(shape, generator=gen)
            if len(shape) == 1:
                t.mul_(0.05).add_(1.0)  # RMSNorm weights around 1, as in a trained model
            else:
                t.mul_(0.02)  # the usual init/trained scale of Llama weights
            data[name] = t.to(torch.bfloat16)
            del t
            weight_map[name] = fname
            total += nbytes(shape)
        save_file(data, str(d / fname), metadata={"format": "pt"})
        del data
        log(f"checkpoint: wrote {fname} ({time.perf_counter() - t0:.1f} s)")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (d / "config.json").write_text(json.dumps(llama_config(n_layers, kv_heads), indent=2))
    os.sync()
    desc = {"params": want, "tensor_bytes": total, "tensors": len(tensors), "files": len(groups),
            "file_bytes": sum(p.stat().st_size for p in d.glob("*.safetensors")),
            "generate_seconds": round(time.perf_counter() - t0, 1)}
    stamp.write_text(json.dumps(desc, indent=2))
    return desc
