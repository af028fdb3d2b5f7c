"""Checking a loaded model against transformers itself: every parameter's full tensor and
every buffer bit for bit against from_pretrained of the source checkpoint, tied weights still
tied (``--check-weights`` of the trainer and the recipes)."""

from __future__ import annotations

import gc

import torch
from torch import nn

from .hub import resolve_source
from .model import build_dtype, clean_name, reference_class


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (on CPU), for bit-for-bit comparisons (NaN == NaN, -0.0 != 0.0)."""
    t = t.detach().contiguous().cpu().reshape(-1)  # 0-dim tensors cannot be viewed as bytes
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def check_weights(model: nn.Module, src: str, model_class=None, log=print, revision=None) -> int:
    """Every parameter's full tensor equals from_pretrained(SRC)'s, converted to the live dtype
    with Tensor.to(), bit for bit; buffers too; tied weights still tied. Raises otherwise.
    SRC is a checkpoint directory or a model id in the local Hugging Face cache (resolved as
    the CLI resolves it, reshard.resolve_source; never downloaded). Returns the number of
    parameters checked. Collective: call it on every rank."""
    src = resolve_source(src, revision)
    cls = model_class or reference_class(model)
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return _check_weights(model, src, cls, log, fsdp1=True)
    return _check_weights(model, src, cls, log, fsdp1=False)


def _check_weights(model: nn.Module, src: str, cls, log, fsdp1: bool) -> int:
    _quiet_transformers()
    # The reference is built in the dtype the live model was built in (reshard.empty_model
    # records it): buffers computed at construction depend on it; parameters are compared
    # after Tensor.to(live dtype) either way.
    ref = cls.from_pretrained(src, dtype=build_dtype(model) or "auto")
    ref_params = dict(ref.named_parameters())
    ref_all = dict(ref.named_parameters(remove_duplicate=False))  # tied aliases too
    # Tied pairs the sharding split into two parameters (reshard.load filled both from one
    # tensor and warned): each is compared with from_pretrained's one tensor.
    untied = dict(getattr(model, "_reshard_untied", None) or {})
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    names = [n for n, _ in named]
    expected = set(ref_params) | {n for pair in untied.items() for n in pair if n in ref_all}
    if len(names) != len(set(names)) or set(names) != expected:
        raise AssertionError(f"parameter names differ from from_pretrained({src}): "
                             f"{sorted(set(names) ^ expected)[:8]}")
    bad = []
    for name, p in named:
        full = full_tensor(p.detach())
        want = ref_all[name].detach().to(full.dtype)
        if full.shape != want.shape or not torch.equal(bits(full), bits(want)):
            bad.append(name)
    ref_buffers = dict(ref.named_buffers())
    n_buffers = 0
    for name, b in ((clean_name(n), b) for n, b in model.named_buffers()):
        n_buffers += 1
        # FSDP1's MixedPrecision(buffer_dtype=...) (accelerate sets it) casts buffers at
        # construction, as it would from_pretrained's: compare in the live dtype.
        want = ref_buffers.get(name)
        if want is not None and fsdp1:
            want = want.to(b.dtype)
        if want is None or b.dtype != want.dtype or not torch.equal(bits(b.detach().cpu()), bits(want)):
            bad.append(f"buffer {name}")
    # Ties as from_pretrained has them (FSDP1 keeps ties inside its FlatParameter, and
    # reshard.load checked the shared entries): each group of names of one reference parameter
    # is one live parameter, unless the sharding split it (reshard.load filled both and warned).
    if not fsdp1:
        def groups(m, clean):
            by_id: dict = {}
            for n, p in m.named_parameters(remove_duplicate=False):
                by_id.setdefault(id(p), set()).add(clean_name(n) if clean else n)
            return list(by_id.values())
        live = groups(model, True)
        split = [set(pair) for pair in untied.items()]
        for g in groups(ref, False):
            if len(g) > 1 and not any(g <= h for h in live) and not any(s <= g for s in split):
                bad.append(f"tied weights {' = '.join(sorted(g))} are no longer tied")
    if bad:
        raise AssertionError(f"{len(bad)} tensor(s) differ from from_pretrained({src}) right after "
                             f"reshard.load: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
    del ref, ref_params, ref_buffers
    gc.collect()
    log(f"check-weights: {len(names)} parameters and {n_buffers} buffer(s) equal from_pretrained({src}) bit for bit "
        f"(live dtype {next(model.parameters()).dtype})" +
        (f"; {len(untied)} tied pair(s) split by the sharding, each equal to the one tensor"
         if untied else ""))
    return len(names)


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
