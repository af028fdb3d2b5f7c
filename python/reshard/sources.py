"""Where reshard.load reads a rank's bytes from: the job's own rank file when OUT holds the
layout converted for this world size (the fastest: one file, laid out for this rank), else
straight from what is there — another layout of OUT (another world size, a save from a job of
another size) or a Hugging Face checkpoint directory (or a model id in the local Hugging Face
cache). The latter two are planned by the C++ core exactly as `reshard convert` would plan the
missing rank file (reshard._C.SourceRankView), so every check of the load is the same, and
only this rank's bytes are read; nothing is stored."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Set

import torch
from torch import nn

from . import _C
from .errors import LayoutMismatchError, NotFoundError
from .layout import POLICY_NAMES, is_hf_checkpoint, read_manifest


@dataclass
class JobSource:
    """What a load reads: `reader` (a _C.RankFile or a _C.SourceRankView: `tensors`, `load`),
    its path or description, the layout key it is planned as, and in words where the bytes
    come from (LoadReport.source)."""
    path: str
    key: str
    reader: Any
    source: str


def target_policy(live_dtype: Optional[torch.dtype]) -> str:
    """The dtype policy a view is planned with: the live dtype when the model has one floating
    dtype (the core converts exactly as Tensor.to() while reading), else keep (the load then
    converts the tensors that differ on the host)."""
    return POLICY_NAMES.get(live_dtype, "keep") if live_dtype is not None else "keep"


def whole_names(names: Iterable[str], prefix: str) -> Set[str]:
    """The names (with and without the base model prefix, as transformers maps keys) of
    tensors stored whole on every rank: the model's persistent buffers."""
    out = set()
    for n in names:
        out.add(n)
        if prefix:
            out.add(f"{prefix}.{n}")
            if n.startswith(prefix + "."):
                out.add(n[len(prefix) + 1:])
    return out


def other_layout(manifest: Dict[str, Any], world_size: int, policy: str,
                 skip_kind: Optional[str] = None) -> Optional[str]:
    """The complete layout of OUT to read a world size `world_size` job from, when none is its
    own: FSDP2 before FSDP1 (whole rows, fewer pieces), the live dtype's policy before keep,
    then the fewest rank files (fewer files to open and check). A layout converted to another
    dtype (--dtype fp16 for a bf16 job) is never read: its values went through that dtype, and
    converting them again would not give what from_pretrained gives (bf16 -> fp16 -> bf16 loses
    what fp16 cannot hold); at the job's own world size such a layout is no match either. Layouts of
    kind `skip_kind` at this world size are the job's own (found wanting: a rank file
    missing) and not used, nor layouts holding part of the model (`parts`: an expert-parallel
    save). None when OUT holds no other complete layout."""
    best, best_rank = None, None
    for key, lay in manifest.get("layouts", {}).items():
        if not lay.get("complete") or len(lay.get("ranks", [])) != lay.get("world_size") or lay.get("parts"):
            continue
        if lay.get("kind") == skip_kind and lay.get("world_size") == world_size:
            continue
        dtype = lay.get("dtype", "keep")
        if dtype not in (policy, "keep"):
            continue
        rank = (lay.get("kind") != "fsdp2", 0 if dtype == policy else 1, lay.get("world_size", 0), key)
        if best_rank is None or rank < best_rank:
            best, best_rank = key, rank
    return best


def another_model_type(src: str, hf_model: nn.Module) -> str:
    """When SRC (a checkpoint, or a reshard output with the source's config.json) names another
    model_type than the model's: what to say (else "")."""
    from .model import reference_class

    ours = getattr(getattr(hf_model, "config", None), "model_type", None)
    try:
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return ""  # no config to compare: transformers says what is missing
    theirs = cfg.get("model_type") if isinstance(cfg, dict) else None
    if not (ours and isinstance(theirs, str) and theirs != ours):
        return ""
    try:
        cls = reference_class(hf_model).__name__
    except StopIteration:
        cls = type(hf_model).__name__
    arch = ", ".join(map(str, cfg.get("architectures") or [])) or theirs
    what = "a conversion of" if os.path.exists(os.path.join(src, "reshard.json")) else "a checkpoint of"
    return (f"{src} is {what} another model: its config.json has model_type {theirs!r} ({arch}), the model is a "
            f"{cls} (model_type {ours!r}). Load this model's own checkpoint or conversion, or build the model "
            f"from this one: reshard.empty_model({src!r})")


def refuse_another_model_type(src: str, hf_model: nn.Module) -> None:
    """A checkpoint whose config.json names another model_type than the model's: refused before
    transformers builds the model's class from that config (which fails somewhere inside, e.g.
    "'Qwen2Config' object has no attribute 'attention_bias'")."""
    why = another_model_type(src, hf_model)
    if why:
        raise LayoutMismatchError(why)


def checkpoint_manifest(src: str, hf_model: nn.Module, names: Iterable[str]) -> str:
    """The model manifest JSON whose conversion maps the checkpoint's keys to the model's names,
    captured from the installed transformers (reshard.model_manifest), when some of `names`
    (the model's parameters) are not keys of the checkpoint (hub names: Mixtral's per-expert
    keys, GPT-NeoX's embed_out, ...); "" when every name is there."""
    from .load import file_key
    from .model import reference_class
    from .model_manifest import build_meta_model, model_manifest

    keys = {name for name, _, _ in _C.checkpoint_tensors(src)}
    prefix = getattr(hf_model, "base_model_prefix", "") or ""
    if all(file_key(n, keys, prefix) is not None for n in names):
        return ""
    refuse_another_model_type(src, hf_model)
    meta = build_meta_model(src, reference_class(hf_model).__name__)
    return json.dumps(model_manifest(meta, checkpoint=src))


def open_view_of_checkpoint(src: str, world_size: int, coord: int, live_dtype, hf_model: nn.Module,
                            param_names: Iterable[str], buffer_names: Iterable[str]) -> JobSource:
    prefix = getattr(hf_model, "base_model_prefix", "") or ""
    manifest_json = checkpoint_manifest(src, hf_model, list(param_names))
    view = _C.SourceRankView.of_checkpoint(src, world_size, coord, dtype=target_policy(live_dtype),
                                           whole=whole_names(buffer_names, prefix),
                                           model_manifest=manifest_json)
    how = "through transformers' conversion, " if manifest_json else ""
    return JobSource(view.description, view.layout_key, view,
                     f"{view.description}, read directly ({how}no conversion stored)")


def open_view_of_layout(out: str, key: str, world_size: int, coord: int, live_dtype, hf_model: nn.Module,
                        buffer_names: Iterable[str]) -> JobSource:
    prefix = getattr(hf_model, "base_model_prefix", "") or ""
    view = _C.SourceRankView.of_layout(out, key, world_size, coord, dtype=target_policy(live_dtype),
                                       whole=whole_names(buffer_names, prefix))
    return JobSource(view.description, view.layout_key, view,
                     f"{view.description}, resharded while reading (no conversion stored)")


def open_job_source(out: str, world_size: int, coord: int, live_dtype, hf_model: nn.Module,
                    param_names: Iterable[str], buffer_names: Iterable[str]) -> JobSource:
    """The source of an FSDP2 (or unsharded) load of shard `coord` of `world_size` from OUT:
    the layout's own rank file when present (preferred), else another complete layout of OUT,
    else OUT as a Hugging Face checkpoint (or a model id in the local cache). Raises the
    NotFoundError of the missing rank file when none of these is there."""
    from .load import open_job_file

    manifest = read_manifest(out) if os.path.isdir(out) else None
    if manifest is not None:
        try:
            path, key, reader = open_job_file(out, world_size, coord, live_dtype)
            return JobSource(path, key, reader, "rank file")
        except NotFoundError:
            other = other_layout(manifest, world_size, target_policy(live_dtype), skip_kind="fsdp2")
            if other is None:
                raise
            return open_view_of_layout(out, other, world_size, coord, live_dtype, hf_model, buffer_names)
    src = hf_source(out)
    if src is not None:
        return open_view_of_checkpoint(src, world_size, coord, live_dtype, hf_model, param_names,
                                       buffer_names)
    path, key, reader = open_job_file(out, world_size, coord, live_dtype)  # raises what is missing
    return JobSource(path, key, reader, "rank file")


def is_hf_source(path: str) -> bool:
    """True when `path` (or the model id it names in the local Hugging Face cache) is a Hugging
    Face checkpoint rather than a reshard output directory."""
    return hf_source(path) is not None


def hf_source(path: str) -> Optional[str]:
    """The Hugging Face checkpoint `path` names (itself, or a model id's cached snapshot), None
    when it is none (a reshard output directory, or nothing)."""
    from .hub import resolve_source

    src = path
    if not os.path.exists(path):
        try:
            src = resolve_source(path)
        except NotFoundError:
            return None
    if is_hf_checkpoint(src) or (os.path.isfile(src) and src.endswith((".safetensors", ".bin"))):
        return src
    return None


def fsdp1_view(out: str, model: nn.Module, world_size: int, coord: int, live_dtype) -> Optional[JobSource]:
    """The FSDP1 job's rank planned over what is there when OUT has no fsdp1 layout for it: a
    complete layout of OUT (with OUT/reshard-model.json, which FSDP1 units are planned from),
    or a Hugging Face checkpoint (its model manifest captured now). None when neither is there."""
    from .load_fsdp1 import fsdp1_job
    from .model import reference_class
    from .model_manifest import build_meta_model, model_manifest

    job = fsdp1_job(model, "reshard.load")
    fsdp1 = (list(job.wrap), job.use_orig_params, job.param_dtype)
    policy = target_policy(live_dtype)
    src = hf_source(out)
    if src is not None:
        inner = getattr(model, "module", model)
        refuse_another_model_type(src, inner)
        meta = build_meta_model(src, reference_class(inner).__name__)
        manifest_json = json.dumps(model_manifest(meta, checkpoint=src))
        view = _C.SourceRankView.of_checkpoint(src, world_size, coord, dtype=policy,
                                               model_manifest=manifest_json, fsdp1=fsdp1)
        return JobSource(view.description, view.layout_key, view,
                         f"{view.description}, read directly (no conversion stored)")
    manifest = read_manifest(out) if os.path.isdir(out) else None
    model_json = os.path.join(out, "reshard-model.json")
    if manifest is None or not os.path.exists(model_json):
        return None
    # Any complete layout, an fsdp1 one of this world size with other units too (load_fsdp1 found
    # none of them to be the job's own): the job's units are planned over it.
    other = other_layout(manifest, world_size, policy)
    if other is None:
        return None
    with open(model_json) as f:
        manifest_json = f.read()
    view = _C.SourceRankView.of_layout(out, other, world_size, coord, dtype=policy,
                                       model_manifest=manifest_json, fsdp1=fsdp1)
    return JobSource(view.description, view.layout_key, view,
                     f"{view.description}, resharded while reading (no conversion stored)")
