"""Tiny Hugging Face checkpoints for end-to-end tests, built with transformers' own classes.

``make_checkpoint(path, arch, dtype, sharded, seed=0)`` builds a small random model and
writes it with ``save_pretrained``; ``sharded=True`` picks a ``max_shard_size`` that yields
at least three ``model-*-of-*.safetensors`` files plus ``model.safetensors.index.json``.

Sizes are chosen so that dim-0 sizes are awkward for FSDP: 37 (vocabulary, prime), 33 /
101 (MLP width), 6 (key/value projection rows, smaller than 8), 20 (GPT-2 and BERT width) and 2 (BERT token
types): world sizes 3, 5 and 8 then give uneven chunks and ranks with empty shards.

Every parameter is overwritten with seeded random values (``torch.randn``), so that no
two rows are alike (biases and norms would otherwise be all zeros or ones, and a wrong
row offset would go unnoticed).

``arch="mixed"`` is not a transformers model: it writes safetensors files directly with
every dtype torch and safetensors share, 0-dim tensors, tensors with a zero-sized
dimension, raw random bit patterns (NaN payloads, infinities, -0.0) and one tensor large
enough to span several 4 KiB checksum chunks.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import torch

ARCHS = ("llama", "qwen2", "gpt2", "bert", "gptj", "codegen", "mixed",
         "mixtral", "qwen3_moe", "deepseek_v3", "gpt_neox")
# Checkpoints whose hub names differ from the model's (transformers renames or fuses them at
# load): their persistent floating buffers are random too, so a buffer loaded wrong shows.
HUB_LAYOUT_ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_neox")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _config_and_class(arch: str):
    import transformers as tr

    if arch == "llama":
        cfg = tr.LlamaConfig(
            vocab_size=37,
            hidden_size=48,
            intermediate_size=101,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=1,  # k_proj / v_proj: 6 rows
            max_position_embeddings=64,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        return cfg, tr.LlamaForCausalLM
    if arch == "qwen2":
        cfg = tr.Qwen2Config(
            vocab_size=37,
            hidden_size=24,
            intermediate_size=33,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,  # k_proj / v_proj (and their biases): 6 rows (head_dim 6: RoPE needs it even)
            max_position_embeddings=64,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
        return cfg, tr.Qwen2ForCausalLM
    if arch == "gpt2":
        cfg = tr.GPT2Config(
            vocab_size=37,
            n_positions=7,  # wpe: 7 rows
            n_embd=20,
            n_layer=2,
            n_head=4,
            bos_token_id=1,
            eos_token_id=2,
        )
        return cfg, tr.GPT2LMHeadModel
    if arch == "bert":
        cfg = tr.BertConfig(
            vocab_size=37,
            hidden_size=20,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=33,
            max_position_embeddings=19,
            type_vocab_size=2,  # token_type_embeddings: 2 rows
            pad_token_id=0,
        )
        return cfg, tr.BertForMaskedLM
    if arch in ("gptj", "codegen"):
        # Non-persistent rotary table `attn.embed_positions` (max_positions x rotary_dim, fp32),
        # computed by the model's _init_weights in from_pretrained: 256 positions are enough
        # for a table computed in bf16/fp16 to differ (0.36 at position 255 in bf16).
        kw = dict(vocab_size=37, n_positions=256, n_embd=24, n_layer=2, n_head=4, rotary_dim=4,
                  n_inner=33, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        if arch == "gptj":
            return tr.GPTJConfig(**kw), tr.GPTJForCausalLM
        return tr.CodeGenConfig(n_ctx=256, **kw), tr.CodeGenForCausalLM
    # Hub layouts (dims that are multiples of 8: grouped_mm needs 16-byte strides in bf16).
    if arch == "mixtral":  # per-expert w1/w2/w3 -> experts.gate_up_proj / down_proj
        return tr.MixtralConfig(vocab_size=37, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                num_experts_per_tok=2, max_position_embeddings=64,
                                tie_word_embeddings=False), tr.MixtralForCausalLM
    if arch == "qwen3_moe":
        return tr.Qwen3MoeConfig(vocab_size=37, hidden_size=32, intermediate_size=24, moe_intermediate_size=16,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_experts=5, num_experts_per_tok=2, max_position_embeddings=64,
                                 tie_word_embeddings=False), tr.Qwen3MoeForCausalLM
    if arch == "deepseek_v3":  # + persistent e_score_correction_bias (kept in fp32 by from_pretrained)
        return tr.DeepseekV3Config(vocab_size=37, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                   first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                                   max_position_embeddings=64, tie_word_embeddings=False), tr.DeepseekV3ForCausalLM
    if arch == "gpt_neox":  # embed_out -> lm_head (every Pythia checkpoint)
        return tr.GPTNeoXConfig(vocab_size=37, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64,
                                tie_word_embeddings=False), tr.GPTNeoXForCausalLM
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _shard_size(total_bytes: int) -> int:
    # Four shards' worth, rounded up: save_pretrained packs greedily, so this gives >= 3 files
    # (a tensor bigger than the limit gets a file of its own).
    return max(1024, total_bytes // 4 + 1)


def _build_transformers(path: str, arch: str, dtype: torch.dtype, sharded: bool, seed: int):
    cfg, cls = _config_and_class(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32))
        if arch in HUB_LAYOUT_ARCHS:
            persistent = set(model.state_dict())
            for n, b in model.named_buffers():
                if n in persistent and b.is_floating_point():
                    b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float32))
    model = model.to(dtype)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if sharded:
        model.save_pretrained(path, max_shard_size=_shard_size(total))
    else:
        # Bigger than the model: one model.safetensors.
        model.save_pretrained(path, max_shard_size=max(10 * total, 1 << 20))


def _random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of `dtype` whose bytes are uniformly random (NaNs, infs, denormals...)."""
    esize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * esize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).clone()


def mixed_tensors(seed: int = 0) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t: Dict[str, torch.Tensor] = {}
    t["scalar.f32"] = torch.tensor(3.25, dtype=torch.float32)
    t["scalar.i64"] = torch.tensor(-(2**40) - 7, dtype=torch.int64)
    t["scalar.bf16.nan"] = torch.tensor(float("nan"), dtype=torch.bfloat16)
    t["bits.bf16"] = _random_bits((13, 7), torch.bfloat16, gen)
    t["bits.f16"] = _random_bits((17, 3), torch.float16, gen)
    t["bits.f32"] = _random_bits((11, 2, 3), torch.float32, gen)
    t["bits.f64"] = _random_bits((6, 2), torch.float64, gen)
    t["special.f32"] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1.5], dtype=torch.float32
    )
    t["ids.i64"] = torch.randint(-(2**62), 2**62, (11,), dtype=torch.int64, generator=gen)
    t["ids.i32"] = torch.randint(-(2**31), 2**31 - 1, (9, 2), dtype=torch.int32, generator=gen)
    t["ids.i16"] = torch.randint(-(2**15), 2**15 - 1, (7,), dtype=torch.int16, generator=gen)
    t["ids.i8"] = torch.randint(-128, 127, (3, 3), dtype=torch.int8, generator=gen)
    t["ids.u8"] = torch.randint(0, 255, (5, 4), dtype=torch.uint8, generator=gen)
    t["mask.bool"] = torch.randint(0, 2, (9, 3), generator=gen).to(torch.bool)
    t["fp8.e4m3"] = _random_bits((10, 3), torch.float8_e4m3fn, gen)
    t["fp8.e5m2"] = _random_bits((4,), torch.float8_e5m2, gen)
    t["empty.rows"] = torch.empty((0, 4), dtype=torch.float32)
    t["empty.cols"] = torch.empty((4, 0), dtype=torch.bfloat16)
    t["one.row"] = torch.randn((1, 5), generator=gen, dtype=torch.float32)
    # Names that need JSON escaping or are not ASCII.
    t['quote"and\\backslash'] = torch.randn((3, 2), generator=gen, dtype=torch.float32)
    t["ünïcødé.名前"] = torch.randn((7,), generator=gen).to(torch.bfloat16)
    # 1031 rows of 12 bytes = 12372 bytes: several 4 KiB chunks, boundaries mid-row.
    t["big.f32"] = torch.randn((1031, 3), generator=gen, dtype=torch.float32)
    return t


def _build_mixed(path: str, dtype: torch.dtype, sharded: bool, seed: int):
    from safetensors.torch import save_file

    tensors = mixed_tensors(seed)
    # The dtype argument selects the dtype of the "model" part only, to keep the interface.
    gen = torch.Generator().manual_seed(seed + 2)
    tensors["model.weight"] = torch.randn((23, 6), generator=gen).to(dtype)
    names = sorted(tensors)
    meta = {"format": "pt"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "mixed-test", "note": "not a real model"}, f)
    if not sharded:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata=meta)
        return
    groups: List[List[str]] = [names[i::3] for i in range(3)]
    weight_map = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in group}, os.path.join(path, fname), metadata=meta)
        for k in group:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def make_checkpoint(path: str, arch: str, dtype: str = "bf16", sharded: bool = False,
                    seed: int = 0) -> str:
    """Writes a tiny checkpoint into `path` (created) and returns `path`.

    arch: llama | qwen2 | gpt2 | bert | mixed; dtype: "bf16" | "fp32" (or a torch dtype).
    """
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    os.makedirs(path, exist_ok=True)
    if arch == "mixed":
        _build_mixed(path, torch_dtype, sharded, seed)
    else:
        _build_transformers(path, arch, torch_dtype, sharded, seed)
    weights = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    if sharded:
        assert len(weights) >= 3, f"{path}: expected >= 3 weight files, got {weights}"
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    else:
        assert weights == ["model.safetensors"], f"{path}: expected one file, got {weights}"
    return path


def weight_files(path: str) -> List[str]:
    """The checkpoint's weight files (sorted names)."""
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def load_source(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read with safetensors.safe_open. When an index exists,
    only tensors that its weight_map places in their file count."""
    from safetensors import safe_open

    index_path = os.path.join(path, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    out: Dict[str, torch.Tensor] = {}
    for fname in weight_files(path):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for k in f.keys():
                if weight_map is not None and weight_map.get(k) != fname:
                    continue
                assert k not in out, f"{k} in two files"
                out[k] = f.get_tensor(k)
    return out


# ---------------------------------------------------------------------------------------
# pytorch_model.bin checkpoints (torch.save zip archives)

BIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bin_mixed_state(dtype: torch.dtype, seed: int) -> Dict[str, torch.Tensor]:
    """Tensors of every kind torch.save writes differently: views into one storage at
    offsets, tied entries on one storage, a Parameter, tensors with Python attributes, 0-dim,
    empty, integer, bool, fp8 (_rebuild_tensor_v3), NaN/inf bit patterns, and a tensor
    spanning several 4 KiB chunks."""
    gen = torch.Generator().manual_seed(seed)
    t: Dict[str, torch.Tensor] = {}
    base = torch.randn((400,), generator=gen).to(dtype)
    t["views.a"] = base[10:40].view(5, 6)        # storage offset 10
    t["views.b"] = base[40:400].view(36, 10)     # offset 40, the rest of the storage
    emb = torch.randn((13, 7), generator=gen).to(dtype)
    t["tied.embed"] = emb
    t["tied.head"] = emb.view(13, 7)             # another tensor on the same storage
    t["param"] = torch.nn.Parameter(torch.randn((5, 3), generator=gen).to(dtype))
    # Python attributes: torch.save writes torch._tensor._rebuild_from_type_v2 and
    # torch._utils._rebuild_parameter_with_state for these.
    attr = torch.randn((4, 2), generator=gen).to(dtype)
    attr.note = "an attribute"
    t["attr.tensor"] = attr
    attr_param = torch.nn.Parameter(torch.randn((3,), generator=gen).to(dtype))
    attr_param.note = 7
    t["attr.param"] = attr_param
    t["scalar"] = torch.tensor(2.5, dtype=dtype)
    t["empty"] = torch.empty((0, 4), dtype=dtype)
    t["ids"] = torch.randint(-(2**40), 2**40, (11,), generator=gen)
    t["mask"] = torch.randint(0, 2, (9, 2), generator=gen).to(torch.bool)
    t["fp8"] = _random_bits((10, 3), torch.float8_e4m3fn, gen)
    t["bits.f32"] = _random_bits((17, 5), torch.float32, gen)
    t["bits.f64"] = _random_bits((9, 4), torch.float64, gen)
    t["bits.bf16"] = _random_bits((21, 3), torch.bfloat16, gen)
    t["bits.f16"] = _random_bits((19, 3), torch.float16, gen)
    t["special.f32"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                                     1e-45, 3.4e38, 65520.0, -65504.0, 1e-8], dtype=torch.float32)
    t["big"] = torch.randn((1031, 3), generator=gen).to(dtype)
    return t


def make_bin_checkpoint(path: str, arch: str, dtype: str = "bf16", sharded: bool = False,
                        seed: int = 0, pickle_protocol: int = 2) -> str:
    """Writes `path`/pytorch_model.bin (or, sharded, pytorch_model-0000i-of-0000n.bin files
    plus pytorch_model.bin.index.json) with torch.save of a state dict, as transformers < 5
    did. transformers 5 always writes safetensors (save_pretrained ignores
    safe_serialization=False), so the state dict is saved by hand.

    arch: qwen2 (tied embeddings: lm_head.weight and model.embed_tokens.weight are two
    entries on one storage) | llama | gpt2 | bert | mixed (_bin_mixed_state)."""
    torch_dtype = BIN_DTYPES[dtype] if isinstance(dtype, str) else dtype
    os.makedirs(path, exist_ok=True)
    if arch == "mixed":
        state = _bin_mixed_state(torch_dtype, seed)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": "mixed-test"}, f)
    else:
        cfg, cls = _config_and_class(arch)
        torch.manual_seed(seed)
        model = cls(cfg)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32))
        model = model.to(torch_dtype)
        model.config.save_pretrained(path)
        state = model.state_dict()
    names = list(state)
    if not sharded:
        torch.save(state, os.path.join(path, "pytorch_model.bin"),
                   pickle_protocol=pickle_protocol)
        return path
    # Three shards of consecutive keys (tied pairs may land in different shards: then each
    # shard holds its own copy of the storage, as torch.save of a sub-dict does).
    groups = [names[i * len(names) // 3:(i + 1) * len(names) // 3] for i in range(3)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin"
        torch.save({k: state[k] for k in group}, os.path.join(path, fname),
                   pickle_protocol=pickle_protocol)
        weight_map.update({k: fname for k in group})
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)
    return path


def _torch_load(path: str):
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        # torch's weights_only unpickler lacks FRAME (pickle protocol 4); these files were
        # written by make_bin_checkpoint, so a full load is safe.
        return torch.load(path, weights_only=False)


def load_bin_source(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a .bin checkpoint, read with torch.load; with an index, only the keys
    its weight_map places in each file."""
    index_path = os.path.join(path, "pytorch_model.bin.index.json")
    if os.path.isfile(path):
        return dict(_torch_load(path))
    if not os.path.exists(index_path):
        return dict(_torch_load(os.path.join(path, "pytorch_model.bin")))
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    out: Dict[str, torch.Tensor] = {}
    for fname in sorted(set(weight_map.values())):
        sd = _torch_load(os.path.join(path, fname))
        for k, v in sd.items():
            if weight_map.get(k) == fname:
                out[k] = v
    return out
