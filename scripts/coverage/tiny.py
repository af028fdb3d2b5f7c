"""Tiny checkpoints of transformers architectures, built from each config class's own defaults.

`tiny_config(model_type, task)` takes the config class the task's model class expects, its
default values (sub-configs filled in), and shrinks every size it recognises (hidden 64, 4
heads / 2 key-value heads, head dim 16, 2 layers, vocabulary 128, 4 experts of which 2 are
active, ...), keeping per-layer lists consistent with the new layer count; `OVERRIDES` fixes
the families a generic rule cannot (hybrid layer patterns, Mamba head counts, ...).

`build(entry, root)` builds the model with that config in the entry's dtype, overwrites every
parameter with seeded random values (so that no two rows are alike; persistent buffers stay
as the constructor made them), writes it with save_pretrained (or torch.save of the state
dict for a `.bin` variant, as transformers < 5 wrote), captures the FSDP1 model manifest, and
classifies the checkpoint's layout against the model: identical names, renamed keys, or keys
that transformers fuses / splits on load (per-expert MoE weights, ...).

`python tiny.py --serve` answers build requests (one JSON object per line on stdin, one
`RESULT {...}` line on stdout each) so that the parent pays the imports once and can kill a
build that hangs (scripts/coverage/matrix.py does).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib
from typing import Any, Dict, List, Optional

# Sizes of the tiny models.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
EXPERT_FFN = 32
LAYERS = 2
VOCAB = 128
EXPERTS = 4
ACTIVE = 2
POSITIONS = 512

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                    "num_decoder_layers", "num_encoder_layers", "depth", "num_blocks", "n_layers_decoder")
_SIZE_RULES = [
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "embedding_size",
              "word_embed_proj_dim", "hidden_dim", "d_embed", "text_hidden_size", "emb_dim", "model_dim",
              "dim", "audio_hidden_size", "projection_dim", "vision_embed_dim", "input_size",
              "attention_hidden_size", "vision_hidden_size", "hidden_size_global")),
    (FFN, ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
           "ffn_hidden_size", "d_ff", "d_inner", "mlp_dim", "inner_hidden_size", "dense_intermediate_size",
           "intermediate_dim", "ff_dim", "mlp_hidden_size", "feed_forward_proj_dim", "inner_dim",
           "filter_size", "hidden_ff_size", "vision_intermediate_size")),
    (EXPERT_FFN, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                  "moe_shared_expert_intermediate_size", "ffn_hidden_size_moe", "expert_hidden_size")),
    (LAYERS, LAYER_COUNT_KEYS),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
             "encoder_attention_heads", "n_heads", "num_attention_heads_vision", "vision_num_attention_heads",
             "index_n_heads")),
    (KV_HEADS, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                "num_key_value_groups_k", "linear_num_key_heads")),
    (HEAD_DIM, ("head_dim", "kv_channels", "attention_head_dim", "attention_head_size", "d_head", "dim_head",
                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim",
                "linear_value_head_dim", "mamba_d_head", "mamba_head_dim", "rwkv_head_size", "index_head_dim",
                "ssm_state_size", "state_size", "mamba_d_state", "index_topk")),
    (VOCAB, ("vocab_size", "n_vocab", "text_vocab_size", "encoder_hash_byte_group_vocab", "entity_vocab_size",
             "pronunciation_vocab_size", "shape_vocab_size", "src_vocab_size", "tgt_vocab_size")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
               "n_experts", "num_experts_total")),
    (ACTIVE, ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "n_activated_experts",
              "top_k", "num_selected_experts", "moe_top_k", "router_top_k", "experts_per_token",
              "top_k_experts")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                 "seq_length", "max_length")),
    (32, ("q_lora_rank", "kv_lora_rank")),
    (8, ("mamba_n_heads", "time_step_rank")),
    (4, ("linear_num_value_heads", "num_memory_slots")),
    (1, ("n_group", "topk_group", "num_expert_group", "topk_groups", "decoder_sparse_step", "mamba_n_groups",
         "n_groups", "shared_expert_count", "n_shared_experts", "num_shared_experts",
         "moe_num_shared_experts")),
    (128, ("mamba_d_ssm",)),
    (3, ("conv_L_cache",)),
]
SIZE_LIMIT = {key: size for size, keys in _SIZE_RULES for key in keys}
# Set whatever the default (a count of leading dense layers: one of the two tiny layers).
FORCED = {"first_k_dense_replace": 1, "num_dense_layers": 1, "moe_layer_start_index": 1,
          "num_nextn_predict_layers": 0}
DROPPED = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
           "output_attentions", "per_layer_config")


def _looks_like_config(v: Any) -> bool:
    return isinstance(v, dict) and any(k in v for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                        "transformers_version", "_name_or_path"))


def _keep_layers(values: List[Any], n: int) -> List[Any]:
    """n entries of a per-layer list, covering as many distinct values as possible (a sliding
    and a full attention layer rather than two sliding ones)."""
    picked = [0]
    for i, v in enumerate(values):
        if len(picked) == n:
            break
        if all(values[j] != v for j in picked):
            picked.append(i)
    for i in range(len(values)):
        if len(picked) == n:
            break
        if i not in picked:
            picked.append(i)
    return [values[i] for i in sorted(picked)]


def _token_ids_fit(d: Dict[str, Any], vocab: int) -> None:
    for k, v in list(d.items()):
        if isinstance(v, bool) or not (k.endswith("token_id") or k.endswith("token_index")
                                       or k.endswith("_token_ids")):
            continue
        if isinstance(v, int) and v >= vocab:
            d[k] = vocab - 1 - zlib.crc32(k.encode()) % 8
        elif isinstance(v, list):
            d[k] = [x if not isinstance(x, int) or x < vocab else vocab - 1 - i % 8 for i, x in enumerate(v)]


def shrink(d: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of config dict `d` with every recognised size capped (nested configs too)."""
    original, d = d, dict(d)
    layers_before = max([v for k, v in d.items() if k in LAYER_COUNT_KEYS and isinstance(v, int)
                         and not isinstance(v, bool) and v > LAYERS] or [0])
    for k, v in list(d.items()):
        if _looks_like_config(v):
            d[k] = shrink(v)
        elif k in FORCED and isinstance(v, int) and not isinstance(v, bool):
            d[k] = FORCED[k]
        elif k in SIZE_LIMIT and isinstance(v, int) and not isinstance(v, bool) and v > SIZE_LIMIT[k]:
            d[k] = SIZE_LIMIT[k]
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("num_heads", "num_kv_heads"),
                      ("n_heads", "n_kv_heads"), ("n_head", "n_kv_heads")):
        before = original.get(heads), original.get(kv)
        if isinstance(before[0], int) and before[0] == before[1] and isinstance(d.get(heads), int):
            d[kv] = d[heads]  # multi-head attention stays multi-head (MLA has no key-value groups)
    if isinstance(d.get("vocab_size"), int):
        _token_ids_fit(d, d["vocab_size"])
    if layers_before:
        for k, v in list(d.items()):
            if isinstance(v, list) and len(v) == layers_before:
                d[k] = _keep_layers(v, LAYERS)
    if isinstance(d.get("qk_nope_head_dim"), int) and isinstance(d.get("qk_rope_head_dim"), int):
        if "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
        if isinstance(d.get("head_dim"), int):
            d["head_dim"] = d["qk_rope_head_dim"]
    return d


def _clean(d: Dict[str, Any]) -> Dict[str, Any]:
    for k in DROPPED:
        d.pop(k, None)
    for k, v in list(d.items()):
        if _looks_like_config(v):
            _clean(v)
        elif k == "head_dim" and v is None:
            d[k] = HEAD_DIM
        elif SIZE_LIMIT.get(k) == KV_HEADS and v is None:
            d[k] = KV_HEADS
    return d


def _in_text_config(values: Dict[str, Any]):
    def apply(d):
        target = d["text_config"] if isinstance(d.get("text_config"), dict) else d
        target.update(values)
        return d
    return apply


def _assistant(text_type: str):
    def apply(d):
        from transformers import CONFIG_MAPPING

        d.update(backbone_hidden_size=HIDDEN, num_centroids=16, centroid_intermediate_top_k=4)
        if d.get("text_config") is None:
            text = shrink(CONFIG_MAPPING[text_type]().to_dict())
            if text_type == "gemma4_text":
                text.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False,
                            use_double_wide_mlp=False, num_kv_shared_layers=text["num_hidden_layers"])
            d["text_config"] = text
        return d
    return apply


def _dbrx(d):
    # transformers 5.17: DbrxAttentionConfig has no rope_theta, which the attention reads; the
    # attention clamps q/k/v with clip_qkv, which must be set.
    d["attn_config"].update(rope_theta=10000.0, clip_qkv=8.0)
    return d


# Per model type: values set after shrinking (None removes a key), or a function of the dict.
OVERRIDES: Dict[str, Any] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_dt_rank": 8, "layers_block_type": None},
    "zamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_expand": 2,
              "mamba_dt_rank": 8, "attention_head_dim": 32, "n_mamba_heads": 2, "attention_hidden_size": 2 * HIDDEN,
              "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    "zamba2": {"hybrid_layer_ids": [1], "mamba_expand": 2, "mamba_headdim": 16, "n_mamba_heads": 8,
               "attention_head_dim": 32, "num_mem_blocks": 1, "attention_hidden_size": 2 * HIDDEN},
    "mamba2": {"num_heads": 8, "head_dim": 16, "expand": 2},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2},
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2, "mamba_d_ssm": 128},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "hybrid_override_pattern": "M*",
                   "layers_block_type": None},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": ACTIVE, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 2, 4]}}},
    "dbrx": _dbrx,
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB,
                     "hidden_size_per_layer_input": 16},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                       "indexer_compress_ratio": 4},
    "qwen4_exp": _in_text_config({"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                  "indexer_budget": 16, "indexer_compress_ratio": 4}),
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "axial_pos_shape": [16, 32],
                 "axial_pos_embds_dim": [32, 32], "hidden_size": HIDDEN, "feed_forward_size": FFN,
                 "attention_head_size": 16, "num_attention_heads": HEADS, "max_position_embeddings": 512,
                 "chunk_size_lm_head": 0, "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16,
                 "num_buckets": 4},
    "gemma4_assistant": _assistant("gemma4_text"),
    "gemma4_unified_assistant": _assistant("gemma4_unified_text"),
    "xlstm": {"embedding_dim": HIDDEN, "num_heads": HEADS, "num_blocks": LAYERS, "qk_dim_factor": 1.0,
              "v_dim_factor": 1.0},
    "rwkv": {"attention_hidden_size": HIDDEN, "intermediate_size": FFN, "context_length": 128},
    # rotary_dim defaults to 64, more than the tiny head (64 / 4 heads).
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "recurrent_gemma": {"lru_width": HIDDEN, "block_types": ["recurrent", "attention"],
                        "attention_window_size": 64},
}


def _encoder_decoder(d):
    """EncoderDecoderModel has no defaults of its own: a tiny BERT encoder and a tiny BERT
    decoder with cross-attention (the bert2bert recipe)."""
    from transformers import BertConfig

    bert = _clean(shrink(BertConfig().to_dict()))
    d["encoder"] = dict(bert)
    d["decoder"] = dict(bert, is_decoder=True, add_cross_attention=True)
    d.update(decoder_start_token_id=bert["pad_token_id"], pad_token_id=bert["pad_token_id"])
    return d


# Per task, per model type: overrides that replace OVERRIDES' for that task (the same type
# built as another head class needs other values).
TASK_OVERRIDES: Dict[str, Dict[str, Any]] = {
    "masked-lm": {
        # ReformerForMaskedLM is bi-directional: no causal LSH / local attention.
        "reformer": dict(OVERRIDES["reformer"], is_decoder=False),
        # EsmConfig's vocabulary is None by default (the ESM-2 alphabet has 33 tokens).
        "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    },
    "seq2seq-lm": {"encoder-decoder": _encoder_decoder},
}

# Variants beyond the bf16 safetensors checkpoint every architecture gets: families whose hub
# checkpoints ship fp16 weights, and families whose hub checkpoints are pytorch_model.bin (in
# the dtype they were published in). "arch@fp16" / "arch@bin-fp32" / "arch@bin-fp16" entries.
FP16_FAMILIES = ("llama", "opt", "gpt_neox", "gptj", "codegen", "phi")
BIN_FAMILIES = {"gpt2": "fp32", "gpt_neo": "fp32", "openai-gpt": "fp32", "opt": "fp16", "gptj": "fp16",
                "gpt_neox": "fp16", "llama": "fp16"}
DTYPE_NAMES = ("bf16", "fp16", "fp32")

TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")
# The auto mapping each task covers, and its family's name in docs/coverage.md.
MAPPINGS = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
FAMILIES = {"causal-lm": "Causal LM (decoder-only)", "masked-lm": "Encoders (masked LM)",
            "seq2seq-lm": "Encoder-decoders (sequence-to-sequence LM)"}


def mapping(task: str = "causal-lm") -> Dict[str, str]:
    """model type -> model class name of the task's auto mapping."""
    from transformers.models.auto import modeling_auto

    if task not in MAPPINGS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return dict(getattr(modeling_auto, MAPPINGS[task]))


def excluded(task: str = "causal-lm") -> Dict[str, str]:
    """The mapping's types the task's matrix leaves out, with the reason. The rule (for the
    encoder and encoder-decoder tasks; the causal-LM matrix takes every type): a model class
    whose `input_modalities` are more than text (images, audio: the batch of token ids is not
    its input) is left out; so is a masked-LM entry whose class is the type's
    sequence-to-sequence class (BART-style denoising), which the encoder-decoder matrix covers."""
    import transformers

    if task == "causal-lm":
        return {}
    out = {}
    seq2seq = mapping("seq2seq-lm")
    for t, name in mapping(task).items():
        modalities = getattr(getattr(transformers, name, None), "input_modalities", "text")
        modalities = (modalities,) if isinstance(modalities, str) else tuple(modalities)
        if modalities != ("text",):
            out[t] = f"multimodal / speech: {name} takes {' + '.join(modalities)} inputs"
        elif task == "masked-lm" and seq2seq.get(t) == name:
            out[t] = f"{name} is the type's sequence-to-sequence class: in the encoder-decoder matrix"
    return out


def model_types(task: str = "causal-lm") -> List[str]:
    skip = excluded(task)
    return [t for t in mapping(task) if t not in skip]


def model_class_name(model_type: str, task: str = "causal-lm") -> str:
    return mapping(task)[model_type]


def entries_for(types: List[str], variants: bool = True) -> List[Dict[str, str]]:
    """The matrix rows: every type's bf16 safetensors checkpoint, then the fp16 / .bin variants
    of the families that ship them."""
    rows = [{"id": t, "model_type": t, "dtype": "bf16", "format": "safetensors"} for t in types]
    if variants:
        rows += [{"id": f"{t}@fp16", "model_type": t, "dtype": "fp16", "format": "safetensors"}
                 for t in FP16_FAMILIES if t in types]
        rows += [{"id": f"{t}@bin-{d}", "model_type": t, "dtype": d, "format": "bin"}
                 for t, d in BIN_FAMILIES.items() if t in types]
    return rows


def parse_entry_id(entry_id: str) -> Dict[str, str]:
    model_type, _, variant = entry_id.partition("@")
    if not variant:
        return {"id": entry_id, "model_type": model_type, "dtype": "bf16", "format": "safetensors"}
    if variant in DTYPE_NAMES:
        return {"id": entry_id, "model_type": model_type, "dtype": variant, "format": "safetensors"}
    fmt, _, dtype = variant.partition("-")
    if fmt != "bin" or dtype not in DTYPE_NAMES:
        raise ValueError(f"{entry_id}: a variant is @fp16, @bf16, @fp32 or @bin-<dtype>")
    return {"id": entry_id, "model_type": model_type, "dtype": dtype, "format": "bin"}


def config_class(model_type: str, task: str = "causal-lm"):
    """The config class the task's model class is built from (qwen3_5 → Qwen3_5TextConfig,
    musicgen → MusicgenDecoderConfig), else the model type's own."""
    import transformers
    from transformers import CONFIG_MAPPING

    own = CONFIG_MAPPING[model_type]
    wanted = getattr(getattr(transformers, model_class_name(model_type, task)), "config_class", None)
    return wanted if isinstance(wanted, type) and wanted is not own else own


def _with_sub_configs(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    for key, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if d.get(key) is None and isinstance(sub, type):
            try:
                d[key] = _with_sub_configs(sub, sub().to_dict())
            except Exception:  # a sub-config without usable defaults stays None
                pass
    return d


def tiny_config(model_type: str, task: str = "causal-lm"):
    cls = config_class(model_type, task)
    override = TASK_OVERRIDES.get(task, {}).get(model_type, OVERRIDES.get(model_type))
    try:
        defaults = cls().to_dict()
    except ValueError:
        if not callable(override):
            raise
        defaults = {}  # a composite config without defaults: the override makes it
    d = shrink(_with_sub_configs(cls, defaults))
    if callable(override):
        d = override(d)
    elif override:
        for k, v in override.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
    return cls.from_dict(_clean(d))


def seed_of(entry_id: str) -> int:
    return zlib.crc32(entry_id.encode())


def randomize(model, seed: int) -> None:
    """Every parameter gets seeded normal values (std 0.5), so rows differ and a wrong row or
    offset shows in the comparison; buffers are left as constructed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.5).to(p.dtype))


def classify(model, src: str) -> Dict[str, Any]:
    """How the checkpoint's keys relate to the model's state_dict: "identical" (same names and
    shapes), "renamed" (transformers renames some keys on load), "fused" (some model tensors
    are built from several checkpoint tensors, or split from one: per-expert MoE weights
    stacked and concatenated, ...)."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    for k in getattr(model, "_keys_to_ignore_on_save", None) or []:
        kept.pop(k, None)
    saved: Dict[str, List[int]] = {}
    for fn in sorted(os.listdir(src)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(src, fn), "pt") as f:
                for k in f.keys():
                    saved[k] = list(f.get_slice(k).get_shape())
    model_shapes = {k: list(v.shape) for k, v in kept.items()}
    if saved == model_shapes:
        return {"layout": "identical", "renamed": [], "fused": []}
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamed, fused = [], {}
    for k in sorted(saved):
        new, pattern = rename_source_key(k, renamings, converters, model.base_model_prefix, state)
        if pattern is not None:
            fused.setdefault(new, []).append(k)
        elif new != k:
            renamed.append([k, new])
    layout = "fused" if fused else "renamed" if renamed else "different"
    return {"layout": layout, "renamed": renamed[:20], "n_renamed": len(renamed),
            "fused": [[t, len(v)] for t, v in list(fused.items())[:20]], "n_fused": len(fused)}


def build(entry: Dict[str, str], root: str, task: str = "causal-lm") -> Dict[str, Any]:
    """Writes ROOT/<id>/src (the checkpoint) and ROOT/<id>/build.json (what was built); returns
    the build record. Re-uses a complete earlier build."""
    import torch
    import transformers

    entry_dir = os.path.join(root, entry["id"])
    src = os.path.join(entry_dir, "src")
    record_path = os.path.join(entry_dir, "build.json")
    if os.path.exists(record_path):
        with open(record_path) as f:
            rec = json.load(f)
        if rec.get("fingerprint") == build_fingerprint():
            rec["cached"] = True
            return rec
    rec: Dict[str, Any] = dict(entry, task=task, src=src, fingerprint=build_fingerprint(),
                               model_class=model_class_name(entry["model_type"], task))
    t0 = time.time()
    stage = "config"
    try:
        config = tiny_config(entry["model_type"], task)
        stage = "build"
        cls = getattr(transformers, rec["model_class"])
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[entry["dtype"]]
        torch.manual_seed(0)
        model = cls._from_config(config, dtype=dtype)
        randomize(model, seed_of(entry["id"]))
        model.eval()
        stage = "save"
        if os.path.isdir(src):
            import shutil

            shutil.rmtree(src)
        os.makedirs(src)
        model.save_pretrained(src)
        rec.update(classify(model, src))
        if entry["format"] == "bin":
            for fn in os.listdir(src):
                if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
                    os.remove(os.path.join(src, fn))
            torch.save(model.state_dict(), os.path.join(src, "pytorch_model.bin"))
        stage = "manifest"
        from reshard import model_manifest

        rc = model_manifest.main([src, "-o", os.path.join(entry_dir, "reshard-model.json")])
        if rc:
            raise RuntimeError(f"python -m reshard.model_manifest exited {rc}")
        state = model.state_dict()
        rec["fsdp1"] = fsdp1_needs(src, rec["model_class"])
        rec.update(
            status="built",
            base_model_prefix=model.base_model_prefix,
            no_split_modules=sorted(set(getattr(model, "_no_split_modules", None) or [])),
            n_params=sum(1 for _ in model.named_parameters()),
            n_buffers=sum(1 for _ in model.named_buffers()),
            persistent_buffers=sorted(n for n, _ in model.named_buffers() if n in state),
            tied=bool(getattr(model, "all_tied_weights_keys", None)),
            numel=sum(p.numel() for p in model.parameters()),
        )
    except ImportError as e:
        import re

        # transformers' message: "X requires the timm library but it was not found ..." per package
        names = sorted(set(re.findall(r"requires the (\S+) library", str(e)))) or [str(e).strip()]
        rec.update(status="unbuildable", stage=stage, error=f"needs a package not installed: {', '.join(names)}"[:600])
    except Exception as e:
        rec.update(status="unbuildable", stage=stage, error=f"{type(e).__name__}: {e}"[:600],
                   traceback=traceback.format_exc()[-1500:])
    rec["build_s"] = round(time.time() - t0, 2)
    os.makedirs(entry_dir, exist_ok=True)
    with open(record_path, "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def fsdp1_needs(src: str, model_class: str) -> Dict[str, Any]:
    """What FullyShardedDataParallel needs to wrap the model as reshard.empty_model builds it
    (from_pretrained's dtypes: keep-in-fp32 modules, frozen parameters): `wrap`, the unit
    classes (the _no_split_modules plus the classes of modules holding parameters of another
    dtype, which a flat parameter cannot mix), and `use_orig_params` (a unit with frozen and
    trainable parameters needs it). A user wrapping such a model has to do the same."""
    import transformers

    import reshard

    model = reshard.empty_model(src, model_class=getattr(transformers, model_class))
    off = sorted(off_dtype_classes(model))
    no_split = sorted(set(getattr(model, "_no_split_modules", None) or []))
    return {"wrap": sorted(set(no_split) | set(off)) if off else None,
            "use_orig_params": any(not p.requires_grad for p in model.parameters())}


def main_dtype(model):
    from collections import Counter

    counts = Counter(p.dtype for p in model.parameters() if p.is_floating_point())
    return counts.most_common(1)[0][0] if counts else None


def off_dtype_classes(model) -> set:
    """Classes of the modules whose own parameters are of a floating dtype other than the
    model's main one."""
    main = main_dtype(model)
    return {type(m).__name__ for m in model.modules()
            if any(p.is_floating_point() and p.dtype != main for p in m.parameters(recurse=False))}


def build_fingerprint() -> str:
    """Changes when this file (the configs, the values, the writer) or transformers changes."""
    import transformers

    with open(os.path.abspath(__file__), "rb") as f:
        own = zlib.crc32(f.read())
    return f"{own:08x}-transformers-{transformers.__version__}"


def serve() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    # The protocol keeps the original stdout; whatever else prints (the manifest writer, a
    # model's own messages) goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    protocol.write("READY\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        rec = build(req["entry"], req["root"], req.get("task", "causal-lm"))
        protocol.write("RESULT " + json.dumps(rec, default=str) + "\n")


class LineReader:
    """Lines of a pipe with a timeout (select on the descriptor, our own buffer: a buffered
    file object may hold a complete line that select cannot see)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""

    def readline(self, timeout: float) -> Optional[str]:
        """The next line, "" at end of file, None when `timeout` seconds pass first."""
        import select

        deadline = time.time() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return ""
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace") + "\n"


def build_with_timeout(entries: List[Dict[str, str]], root: str, timeout: float, task: str = "causal-lm",
                       log=None, progress=None) -> List[Dict[str, Any]]:
    """Builds `entries` in one server process (restarted after a build that hangs or kills it)."""
    import subprocess

    def start():
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL, bufsize=0)
        reader = LineReader(p.stdout.fileno())
        if (reader.readline(300) or "").strip() != "READY":
            stop(p)
            raise RuntimeError("the build server did not start")
        return p, reader

    def stop(p):
        p.kill()  # the server this function started, by its handle
        p.wait(30)

    out: List[Dict[str, Any]] = []
    p = reader = None
    for i, entry in enumerate(entries):
        cached = _cached_build(entry, root)
        if cached is not None:
            out.append(cached)
            continue
        if p is None:
            p, reader = start()
        t0 = time.time()
        p.stdin.write((json.dumps({"entry": entry, "root": root, "task": task}) + "\n").encode())
        p.stdin.flush()
        rec: Optional[Dict[str, Any]] = None
        while rec is None:
            line = reader.readline(timeout - (time.time() - t0))
            if not line:
                break
            if line.startswith("RESULT "):
                rec = json.loads(line[len("RESULT "):])
        if rec is None:
            why = "did not finish within" if p.poll() is None else f"killed the build process (exit {p.poll()}) within"
            rec = dict(entry, status="unbuildable", stage="build",
                       error=f"building and saving {why} {timeout:.0f} s", build_s=round(time.time() - t0, 2))
            stop(p)
            p = reader = None
        out.append(rec)
        if progress:
            progress(i, len(entries), rec)
    if p is not None:
        p.stdin.close()
        stop(p)
    return out


def _cached_build(entry: Dict[str, str], root: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(root, entry["id"], "build.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rec = json.load(f)
    if rec.get("fingerprint") != build_fingerprint() or rec.get("status") != "built":
        return None  # rebuilt (an earlier failure may have been a timeout on a busy machine)
    rec["cached"] = True
    return rec


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(__doc__)
        sys.exit(2)
