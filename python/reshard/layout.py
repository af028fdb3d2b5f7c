"""The on-disk rules as the Python package sees them. Every rule (rank file names, layout
keys, the chunk rule, the manifest) is the C++ core's (formats/), reached through the
extension: nothing here restates one. What is torch-specific (dtype names to torch dtypes)
lives here and only here."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _C
from .errors import NotFoundError

# torch dtype -> the dtype policy that converts into it (`reshard convert --dtype`).
POLICY_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# safetensors dtype name -> torch dtype attribute (torch builds may lack some)
_TORCH_DTYPE_NAMES: Dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "F16": "float16", "BF16": "bfloat16", "U32": "uint32", "I32": "int32", "F32": "float32",
    "U64": "uint64", "I64": "int64", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; ValueError for those torch cannot hold
    element by element (F6_*, F4)."""
    attr = _TORCH_DTYPE_NAMES.get(name)
    dt = getattr(torch, attr, None) if attr else None
    if dt is None:
        raise ValueError(f"safetensors dtype {name} has no element-wise torch dtype")
    return dt


def safetensors_dtype(dtype: torch.dtype) -> Optional[str]:
    """The safetensors name of a torch dtype, None when it has none."""
    for name, attr in _TORCH_DTYPE_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    return None


def rank_file_name(rank: int, world_size: int) -> str:
    """"rank-00003-of-00008.reshard" (formats/rank-file.md)."""
    return _C.rank_file_name(rank, world_size)


def chunk_rows(n: int, world_size: int, rank: int) -> Tuple[int, int]:
    """The FSDP2 chunk rule: rows [start, end) of `n` that shard `rank` of `world_size` holds."""
    return tuple(_C.chunk_rows(n, world_size, rank))


def layout_key(world_size: int, fsdp1: Optional[Tuple[Sequence[str], bool, str]] = None,
               dtype: str = "keep") -> str:
    """The key (and directory name) of a layout: fsdp2-wsN[-policy], or with
    fsdp1=(wrap classes, use_orig_params, param_dtype) the fsdp1 one."""
    return _C.layout_key(world_size, fsdp1=(list(fsdp1[0]), bool(fsdp1[1]), fsdp1[2]) if fsdp1 else None,
                         dtype=dtype)


def flat_entry_name(unit: str) -> str:
    """The rank-file entry of an FSDP1 unit's FlatParameter ("<unit>._flat_param")."""
    return _C.flat_entry_name(unit)


def read_manifest(out: str) -> Optional[Dict[str, Any]]:
    """OUT/reshard.json, checked by the core's parser (formats/manifest.md), as a dict; None
    when OUT has none."""
    text = _C.read_manifest(str(out))
    return None if text is None else json.loads(text)


_HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")


def is_hf_checkpoint(path: str) -> bool:
    """True when `path` is a Hugging Face checkpoint directory (weights, no reshard.json)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "reshard.json")):
        return False
    names = os.listdir(path)
    return any(n in _HF_WEIGHT_FILES or n.endswith(".safetensors") for n in names)


def convert_output_for(src: str) -> str:
    """A sensible output directory for converting `src`: beside it, never inside it."""
    src = os.path.normpath(os.path.abspath(src))
    return src + "-reshard"


def require_manifest(out: str, command: str) -> Dict[str, Any]:
    """The manifest of OUT; NotFoundError saying what to run when there is none. `command` is
    the convert command (with "<checkpoint>" and OUT in it) that would make the layout; when
    OUT is itself a Hugging Face checkpoint, the message says so and gives the command for it,
    writing beside it."""
    manifest = read_manifest(out)
    if manifest is None:
        if is_hf_checkpoint(out):
            fixed = command.replace("<checkpoint>", out).replace(f"-o {out}", f"-o {convert_output_for(out)}")
            raise NotFoundError(f"{out} is a Hugging Face checkpoint, not a reshard output directory: "
                                f"convert it first, then load the output: {fixed}")
        instead = path_hint(out)
        if instead:
            raise NotFoundError(f"{out}: {instead}")
        raise NotFoundError(f"{out}: no reshard.json; this is not a reshard output directory. "
                            f"Create one with: {command}")
    return manifest


def path_hint(out: str) -> str:
    """What OUT is, when it is not a reshard output directory but is near one (a rank file, a
    layout directory, a --save-dir holding step-* checkpoints) or is not there: the path to pass
    instead. "" when there is nothing better to say. The core's rule (src/ops/path_hint.cc), as
    relayout, verify and inspect say it."""
    return _C.path_hint(str(out))


def layout_rank_file(out: str, key: str, rank: int, world_size: int,
                     manifest: Optional[Dict[str, Any]] = None) -> str:
    """Path of rank `rank`'s file of layout `key` in OUT."""
    layout = (manifest or {}).get("layouts", {}).get(key, {})
    return os.path.join(out, layout.get("dir", key), rank_file_name(rank, world_size))


def layouts_of_kind(manifest: Dict[str, Any], kind: str, world_size: int) -> List[str]:
    return [k for k, lay in manifest.get("layouts", {}).items()
            if lay.get("kind") == kind and lay.get("world_size") == world_size]
