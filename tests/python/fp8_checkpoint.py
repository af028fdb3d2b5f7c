"""A tiny DeepSeek-V3 checkpoint in the FP8 hub format (DeepSeek-V3, Qwen3-FP8): every
nn.Linear weight of the decoder layers (attention, dense MLP, routed and shared experts; not the
router, embeddings, norms or lm_head) stored as float8_e4m3fn with a float32 `weight_scale_inv`
per 128x128 block (the last block of a dim smaller where the dim is not a multiple of 128), and
config.json's quantization_config {quant_method: fp8, weight_block_size: [128, 128]}.

The quantization is the hub's (written here, not taken from transformers): per block,
scale_inv = amax / 448 (1 for an all-zero block), weight = clamp(w / scale_inv, -448, 448)
rounded to e4m3fn, in float32.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Tuple

import torch

BLOCK = (128, 128)
FP8_MAX = 448.0
# Linear weights of the decoder layers, as the hub names them (per-expert keys).
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                       r"|mlp\.(gate_proj|up_proj|down_proj)"
                       r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
                       r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight$")


def config(**over):
    """Tiny DeepSeek-V3: dims below 128 (q_lora_rank 96, kv_a rows 80, kv_b in 64), over 128 and
    not a multiple of it only where transformers' dequantization agrees (see quantize_blocks),
    and multiples of 128 whose rows FSDP cuts inside a block at world sizes 2 and 3
    (o_proj 256 rows: 86/172 at 3; dense MLP 384 rows: 192 at 2)."""
    import transformers as tr

    kw = dict(vocab_size=64, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
              n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=96,
              kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
              topk_group=1, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(over)
    return tr.DeepseekV3Config(**kw)


def quantize_blocks(w: torch.Tensor, block=BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(R/bm), ceil(C/bn)]) of 2-D `w`."""
    rows, cols = w.shape
    bm, bn = block
    sr, sc = -(-rows // bm), -(-cols // bn)
    w32 = w.to(torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            blk = w32[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            amax = blk.abs().max()
            inv = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
            s[i, j] = inv
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (blk / inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def write(path: str, seed: int = 0, cfg=None, drop_scale: str = "") -> Dict[str, torch.Tensor]:
    """Writes the checkpoint to `path` (model.safetensors + config.json); returns its tensors.
    `drop_scale`: leave that weight's weight_scale_inv out (a broken checkpoint)."""
    import transformers as tr
    from safetensors.torch import load_file, save_file

    cfg = cfg or config()
    torch.manual_seed(seed)
    model = tr.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for b in model.buffers():  # e_score_correction_bias: random, so a wrong load shows
            if b.is_floating_point() and b.dim() == 1 and b.numel() == cfg.n_routed_experts:
                b.copy_(torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)  # hub layout: per-expert keys
    sd = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if QUANTIZED.match(k):
            q, s = quantize_blocks(v)
            out[k] = q
            if k != drop_scale:
                out[k[: -len("weight")] + "weight_scale_inv"] = s
        else:
            out[k] = v
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "weight_block_size": list(BLOCK)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return out
