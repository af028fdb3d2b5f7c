"""Captures transformers' checkpoint conversion for a model and a checkpoint: which model tensor
is which checkpoint tensors, renamed, stacked, concatenated or split (formats/model-manifest.md,
"conversion").

transformers v5 renames and fuses checkpoint keys at load time (conversion_mapping.py,
WeightConverter in core_model_loading.py) and reverts it at save_pretrained, so hub checkpoints
keep their old layout (Mixtral's per-expert w1/w2/w3, GPT-NeoX's embed_out, ...). This module
resolves the model's own conversion list against the checkpoint's real keys exactly as
from_pretrained does (its own rename_source_key and key order), then runs each converter's ops
on symbolic tensors: every op transformers uses for the architectures it ships is a pure
rearrangement (stack, cat, chunk), so the result is a small expression per model tensor that the
torch-free core executes with bounded memory (include/reshard/plan/conversion.h). Ops that are
not pure rearrangements we can express (transpose, interleave, permutes, quantizer ops) are
refused by name.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn


class UnsupportedOp(Exception):
    """A conversion op (or torch function inside one) that the plan cannot express."""


def _norm_dim(dim: int, rank: int) -> int:
    d = dim + rank if dim < 0 else dim
    if not 0 <= d < max(rank, 1):
        raise UnsupportedOp(f"dim {dim} of a {rank}-dim tensor")
    return d


class Sym:
    """A tensor known only by its shape and how it is made from checkpoint keys."""

    __slots__ = ("expr", "shape")

    def __init__(self, expr: Dict[str, Any], shape: Sequence[int]):
        self.expr = expr
        self.shape = tuple(int(s) for s in shape)

    @classmethod
    def key(cls, name: str, dtype: str, shape: Sequence[int]) -> "Sym":
        return cls({"op": "key", "key": name, "dtype": dtype, "shape": [int(s) for s in shape]}, shape)

    # The tensor methods the rearranging ops call.
    def contiguous(self, *a, **k) -> "Sym":
        return self

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[_norm_dim(dim, len(self.shape))]

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getattr__(self, name):
        raise UnsupportedOp(f"tensor.{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "stack":
            tensors, dim = (list(args[0]), args[1] if len(args) > 1 else kwargs.get("dim", 0))
            return _stack(tensors, dim)
        if name in ("cat", "concat", "concatenate"):
            tensors, dim = (list(args[0]), args[1] if len(args) > 1 else kwargs.get("dim", 0))
            return _cat(tensors, dim)
        if name == "chunk":
            t = args[0]
            chunks = args[1] if len(args) > 1 else kwargs["chunks"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            return _chunk(t, chunks, dim)
        raise UnsupportedOp(f"torch.{name}")


def _stack(tensors: List[Sym], dim: int) -> Sym:
    if not tensors or not all(isinstance(t, Sym) for t in tensors):
        raise UnsupportedOp("torch.stack of non-checkpoint tensors")
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        raise UnsupportedOp("torch.stack of tensors of different shapes")
    d = _norm_dim(dim, len(shape) + 1)
    return Sym({"op": "stack", "dim": d, "of": [t.expr for t in tensors]}, shape[:d] + (len(tensors),) + shape[d:])


def _cat(tensors: List[Sym], dim: int) -> Sym:
    if not tensors or not all(isinstance(t, Sym) for t in tensors):
        raise UnsupportedOp("torch.cat of non-checkpoint tensors")
    shape = list(tensors[0].shape)
    d = _norm_dim(dim, len(shape))
    for t in tensors[1:]:
        if len(t.shape) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(t.shape, shape)) if i != d):
            raise UnsupportedOp("torch.cat of tensors of incompatible shapes")
    shape[d] = sum(t.shape[d] for t in tensors)
    if len(tensors) == 1:
        return tensors[0]
    return Sym({"op": "cat", "dim": d, "of": [t.expr for t in tensors]}, shape)


def _chunk(t: Sym, chunks: int, dim: int) -> Tuple[Sym, ...]:
    """torch.chunk: pieces of ceil(n / chunks) along dim, the last one smaller, maybe fewer."""
    d = _norm_dim(dim, len(t.shape))
    n = t.shape[d]
    size = -(-n // chunks) if chunks > 0 else 0
    out = []
    start = 0
    while size and start < n:
        stop = min(n, start + size)
        shape = list(t.shape)
        shape[d] = stop - start
        out.append(Sym({"op": "slice", "dim": d, "start": start, "stop": stop, "of": [t.expr]}, shape))
        start = stop
    return tuple(out)


_DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def fp8_config(config) -> Optional[Dict[str, Any]]:
    """config.json's quantization_config when it is transformers' finegrained FP8 (quant_method
    "fp8": DeepSeek-V3, Qwen3-FP8), else None."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    return q if q.get("quant_method") == "fp8" else None


def mxfp4_config(config) -> Optional[Dict[str, Any]]:
    """config.json's quantization_config when it is gpt-oss's MXFP4 (quant_method "mxfp4")."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    return q if q.get("quant_method") == "mxfp4" else None


def mxfp4_quantizer_for(config, policy: str):
    """transformers' own MXFP4 quantizer (Mxfp4HfQuantizer) with dequantize=True: what
    from_pretrained does without Triton kernels (a CPU, or `Mxfp4Config(dequantize=True)`, the
    fine-tuning recipe): each expert projection's blocks and scales dequantized to bfloat16. Policy
    "keep" is refused: transformers' MXFP4 model holds Triton-swizzled tensors in its experts, not
    parameters that FSDP can shard."""
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    if policy != "dequantize":
        raise ValueError("MXFP4 checkpoints (quant_method mxfp4) are dequantized at convert (--quantized "
                         "dequantize): transformers' MXFP4 model holds Triton-swizzled expert tensors, "
                         "not parameters FSDP can shard, so there is no layout to keep them in")
    qc = AutoQuantizationConfig.from_dict(dict(mxfp4_config(config)))
    qc.dequantize = True
    return AutoHfQuantizer.from_config(qc, pre_quantized=True)


def _symbolic_mxfp4(blocks, scales):
    """integrations.mxfp4.dequantize_convertops on checkpoint keys: the dequant_mxfp4 node of
    formats/model-manifest.md (blocks U8 [E, N, G, 16], scales U8 [E, N, G] -> bfloat16
    [E, G*32, N], transformers' convert_moe_packed_tensors)."""
    if not isinstance(blocks, Sym) or not isinstance(scales, Sym) or \
            blocks.expr["op"] != "key" or scales.expr["op"] != "key":
        raise UnsupportedOp("Mxfp4Dequantize of a tensor that is not a checkpoint key")
    b, s = blocks.expr, scales.expr
    if b["dtype"] != "U8" or s["dtype"] != "U8":
        raise UnsupportedOp(f"Mxfp4Dequantize of {b['key']} ({b['dtype']}) with {s['key']} ({s['dtype']}): "
                            "U8 blocks and scales expected")
    if len(blocks.shape) != 4 or blocks.shape[3] != 16 or list(scales.shape) != list(blocks.shape[:3]):
        raise UnsupportedOp(f"Mxfp4Dequantize of {b['key']} {list(blocks.shape)} with {s['key']} "
                            f"{list(scales.shape)}: [E, N, G, 16] blocks and [E, N, G] scales expected")
    e, n, g, _ = blocks.shape
    return Sym({"op": "dequant_mxfp4", "dtype": "BF16", "of": [b, s]}, [e, g * 32, n])


def quantizer_for(config, policy: str):
    """transformers' own FP8 quantizer of a pre-quantized checkpoint (FineGrainedFP8HfQuantizer):
    policy "dequantize" is from_pretrained on a machine without a GPU (its validate_environment
    sets dequantize=True there), "keep" is the FP8 model a GPU gets (FP8Linear / FP8Experts
    holding the weight and its weight_scale_inv)."""
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    qc = AutoQuantizationConfig.from_dict(dict(fp8_config(config)))
    qc.dequantize = policy == "dequantize"
    return AutoHfQuantizer.from_config(qc, pre_quantized=True)


def _symbolic_dequantize(block_size):
    """Fp8Dequantize._dequantize_one on checkpoint keys: the dequant_fp8 node of
    formats/model-manifest.md. transformers derives the block from the scale grid (rows //
    scale_rows, cols // scale_cols), multiplies float32(weight) by the float32 scale and rounds
    once to the model parameter's dtype (`output_dtype`); the node records that block and dtype.
    Refused: weights other than float8_e4m3fn (FP4-packed int8), scales other than float32
    (E8M0), and grids whose derived block is not the checkpoint's weight_block_size where a dim
    has several blocks (transformers would scale rows by another block's scale)."""
    def dequantize_one(quantized, scales, output_dtype=None):
        if not isinstance(quantized, Sym) or not isinstance(scales, Sym) or \
                quantized.expr["op"] != "key" or scales.expr["op"] != "key":
            raise UnsupportedOp("Fp8Dequantize of a tensor that is not a checkpoint key")
        w, sc = quantized.expr, scales.expr
        if w["dtype"] != "F8_E4M3":
            raise UnsupportedOp(f"Fp8Dequantize of {w['key']}, a {w['dtype']} weight (only F8_E4M3 is supported)")
        if sc["dtype"] != "F32":
            raise UnsupportedOp(f"Fp8Dequantize with {sc['key']}, {sc['dtype']} scales (only F32 is supported)")
        if len(quantized.shape) < 2 or len(scales.shape) != len(quantized.shape) or \
                scales.shape[:-2] != quantized.shape[:-2]:
            raise UnsupportedOp(f"Fp8Dequantize of {w['key']} {list(quantized.shape)} with scale "
                                f"{sc['key']} {list(scales.shape)}")
        rows, cols = quantized.shape[-2:]
        srows, scols = scales.shape[-2:]
        if rows % srows or cols % scols:  # transformers' own ValueError
            raise ValueError(f"Weight shape ({rows}, {cols}) not divisible by scale grid ({srows}, {scols}).")
        bm, bn = rows // srows, cols // scols
        if block_size:
            cm, cn = int(block_size[0]), int(block_size[1])
            hub = (-(-rows // cm), -(-cols // cn))
            if (srows, scols) != hub or (srows > 1 and bm != cm) or (scols > 1 and bn != cn):
                raise UnsupportedOp(
                    f"Fp8Dequantize of {w['key']} {[rows, cols]} with scale grid {[srows, scols]}: "
                    f"transformers derives a {bm}x{bn} block from the grid, the checkpoint's "
                    f"weight_block_size is {cm}x{cn}, so its dequantized weight would not be the "
                    "checkpoint's values")
        if output_dtype is None:
            name = "F32"  # transformers: the float32 scales' dtype
        else:
            name = _DTYPE_NAMES.get(str(output_dtype).replace("torch.", ""))
            if name is None:
                raise UnsupportedOp(f"Fp8Dequantize to {output_dtype}")
        return Sym({"op": "dequant_fp8", "block": [bm, bn], "dtype": name, "of": [w, sc]}, quantized.shape)

    return dequantize_one


def _natural_order(keys):
    from transformers.core_model_loading import dot_natural_key

    return sorted(keys, key=dot_natural_key)


def capture_conversion(model: nn.Module, tensors: Sequence[Tuple[str, str, Sequence[int]]],
                       key_mapping: Optional[Dict[str, str]] = None, hf_quantizer=None,
                       quantized_policy: Optional[str] = None) -> Dict[str, Any]:
    """The conversion of checkpoint `tensors` ((key, dtype name, shape), as
    reshard._C.checkpoint_tensors gives them) into `model` (meta parameters are fine):
    {"transformers", "targets": [{"name", "shape", "expr"}], "refused": [why, ...]}.
    Only tensors whose key or layout changes are targets; keys that map to themselves, and
    keys the model does not have (from_pretrained drops those), are left out.
    `hf_quantizer` (quantizer_for; `model` already prepared by it): the conversion of a
    quantized checkpoint as from_pretrained runs it with that quantizer, recorded with
    "quantization": {"method", "policy": `quantized_policy`, "weight_block_size"}."""
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    q = getattr(model.config, "quantization_config", None)
    if q is not None and hf_quantizer is None:
        method = (q if isinstance(q, dict) else q.to_dict()).get("quant_method")
        why = ("FP8 and MXFP4 checkpoints are captured with reshard.model_manifest's policy (--quantized)"
               if method in ("fp8", "mxfp4")
               else "quantized checkpoints other than FP8 with block scales (quant_method fp8) and "
                    "MXFP4 (quant_method mxfp4) are not supported")
        return {"transformers": transformers.__version__, "targets": [],
                "refused": [f"config.json quantization_config: quant_method {method!r}: {why}"]}
    transforms = get_model_conversion_mapping(model, key_mapping=key_mapping, hf_quantizer=hf_quantizer,
                                              add_legacy=True)
    block_size = None
    method = None
    if hf_quantizer is not None:
        block_size = getattr(hf_quantizer.quantization_config, "weight_block_size", None)
        method = hf_quantizer.quantization_config.quant_method
        method = getattr(method, "value", method)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    info = {name: (dtype, list(shape)) for name, dtype, shape in tensors}

    # The grouping loop of from_pretrained (core_model_loading.convert_and_load_state_dict_in_model).
    groups: Dict[str, Dict[str, Any]] = {}
    for key in _natural_order(info):
        new, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if new not in meta and key in meta:
            new, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if new not in meta:
            continue  # unexpected: from_pretrained drops it; convert keeps it under its own name
        if pattern is not None:
            g = groups.setdefault(new, {"converter": copy.deepcopy(by_pattern[pattern]), "keys": []})
        else:
            g = groups.setdefault(new, {"converter": None, "keys": []})
        g["keys"].append((pattern, key))

    targets: List[Dict[str, Any]] = []
    refused: List[str] = []
    for first, g in groups.items():
        conv = g["converter"]
        if conv is None:
            key = g["keys"][0][1]
            if key != first:
                dtype, shape = info[key]
                targets.append({"name": first, "shape": shape, "expr": Sym.key(key, dtype, shape).expr})
            continue
        ops = [type(o).__name__ for o in conv.operations]
        for o in conv.operations:
            if type(o).__name__ == "Fp8Dequantize":
                o._dequantize_one = _symbolic_dequantize(block_size)
        for pattern, key in g["keys"]:
            dtype, shape = info[key]
            conv.add_tensor(first, key, pattern, (lambda s=Sym.key(key, dtype, shape): s))
        try:
            if "Mxfp4Dequantize" in ops:
                import transformers.integrations.mxfp4 as mx
                from unittest import mock

                with mock.patch.object(mx, "dequantize_convertops", _symbolic_mxfp4):
                    out = conv.convert(first, model=model, config=model.config)
            else:
                out = conv.convert(first, model=model, config=model.config)
        except UnsupportedOp as e:
            refused.append(f"{first}: op {'/'.join(ops)} of transformers' conversion is not supported ({e})")
            continue
        except Exception as e:  # transformers' own error (a missing expert, a shape it refuses)
            refused.append(f"{first}: transformers' conversion {'/'.join(ops)} fails on this checkpoint: {e}")
            continue
        for name, value in out.items():
            value = value[0] if isinstance(value, list) and len(value) == 1 else value
            if not isinstance(value, Sym):
                refused.append(f"{name}: op {'/'.join(ops)} of transformers' conversion is not supported")
                continue
            want = list(meta[name].shape) if name in meta else None
            if want is None:
                continue  # not a model tensor (from_pretrained reports it unexpected)
            if list(value.shape) != want:
                refused.append(f"{name}: transformers' conversion {'/'.join(ops)} gives shape "
                               f"{list(value.shape)}, the model has {want}")
                continue
            if value.expr["op"] == "key" and value.expr["key"] == name:
                continue  # itself (the FP8 converter passes weights without a scale through)
            targets.append({"name": name, "shape": list(value.shape), "expr": value.expr})
    targets.sort(key=lambda t: t["name"])
    out = {"transformers": transformers.__version__, "targets": targets, "refused": refused}
    if hf_quantizer is not None:
        out["quantization"] = {"method": str(method), "policy": quantized_policy,
                               "weight_block_size": [int(b) for b in block_size or []]}
    return out


def hub_names_cause(model: nn.Module, file_keys: Sequence[str], missing: Sequence[str]) -> Optional[str]:
    """Why the model's parameters `missing` are not among `file_keys` when the file holds
    transformers' hub names for them (converted without the model manifest's conversion):
    a sentence naming one example, or None when that is not the cause."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        transforms = get_model_conversion_mapping(model, key_mapping=None, hf_quantizer=None, add_legacy=True)
    except Exception:
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    wanted = set(missing)
    model_names = {n for n, _ in model.named_parameters()}
    for key in file_keys:
        if key in model_names:
            continue
        new, pattern = rename_source_key(key, renamings, converters, None, None)
        if new != key and (new in wanted or any(m.endswith(new) or new.endswith(m) for m in wanted)):
            how = "fuses" if pattern is not None else "renames"
            return (f"this checkpoint uses transformers' hub names for {type(model).__name__} (e.g. {key}, "
                    f"which transformers {how} into {new} at load time), and the rank files keep them: they "
                    "were converted without the model manifest's conversion")
    return None
