"""A tiny gpt-oss checkpoint in the MXFP4 hub format (openai/gpt-oss-20b, -120b): each expert
projection stored as `<proj>_blocks` (uint8 [experts, out, in / 32, 16]: 32 FP4 e2m1 values per
block, two per byte, the low nibble first) and `<proj>_scales` (uint8 [experts, out, in / 32]:
an E8M0 power of two per block, 127 meaning 2^0), the biases as they are, and config.json's
quantization_config {quant_method: mxfp4}.

The packing is the format's (written here, not taken from transformers): the expert weight
[experts, in, out] as the model holds it is transposed to [experts, out, in], each row cut into
blocks of 32; a block's exponent is chosen so its largest |value| fits 6 (the largest FP4
value), and each value is rounded to the nearest FP4 value after dividing by 2^exponent.
`exponents` widens the exponents (a test of the whole E8M0 range a row can hold).
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; 8-15 the negatives


def config(**over):
    import transformers as tr

    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=64, sliding_window=16,
              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    kw.update(over)
    return tr.GptOssConfig(**kw)


def pack(w: torch.Tensor):
    """(blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows, cols / 32]) of `w`
    [..., rows, cols] (float32)."""
    *lead, rows, cols = w.shape
    assert cols % 32 == 0
    blk = w.to(torch.float32).reshape(*lead, rows, cols // 32, 32)
    amax = blk.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).to(torch.int32)
    exp = exp.clamp(-127, 127)
    scaled = blk / torch.pow(2.0, exp.to(torch.float32)).unsqueeze(-1)
    mag = scaled.abs().clamp(max=6.0)
    code = (mag.unsqueeze(-1) - FP4).abs().argmin(-1)  # nearest magnitude
    code = code + 8 * (scaled < 0).to(code.dtype)
    code = code.to(torch.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def write(path: str, seed: int = 0, cfg=None, drop_scales: str = "", wide_exponents: bool = False
          ) -> Dict[str, torch.Tensor]:
    """Writes the checkpoint to `path` (model.safetensors + config.json); returns its tensors.
    `drop_scales`: leave that `<proj>_scales` out (a broken checkpoint). `wide_exponents`:
    layer 0's down_proj blocks take exponents across E8M0's range (-127 ... +100)."""
    import transformers as tr
    from safetensors.torch import save_file

    cfg = cfg or config()
    torch.manual_seed(seed)
    model = tr.GptOssForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    gen = torch.Generator().manual_seed(seed + 1)
    for k, v in sd.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            w = v.transpose(1, 2).to(torch.float32)  # [experts, out, in]
            if wide_exponents and k == "model.layers.0.mlp.experts.down_proj":
                # each block scaled by its own power of two in [2^-120, 2^100)
                shift = torch.randint(-120, 100, (*w.shape[:-1], w.shape[-1] // 32, 1), generator=gen)
                w = (w.reshape(*w.shape[:-1], -1, 32) * torch.pow(2.0, shift.to(torch.float32))).reshape(w.shape)
            blocks, scales = pack(w)
            out[k + "_blocks"] = blocks
            if k + "_scales" != drop_scales:
                out[k + "_scales"] = scales
        else:
            out[k] = v
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return out
