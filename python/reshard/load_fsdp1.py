"""FSDP1 (FullyShardedDataParallel, one FlatParameter per wrapped unit): what the live job's
layout is (its units, FlatParameters, shard coordinate), loading a rank file of the matching
fsdp1 layout into the local flat shards, and the param_init_fn that keeps tied weights tied."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .engine import LoadReport, flat_info, open_rank_file, prepare_quietly, target, target_device
from .errors import InvalidArgumentError, LayoutMismatchError, UnsupportedError
from .layout import (POLICY_NAMES, flat_entry_name, layout_key, layout_rank_file, layouts_of_kind,
                     require_manifest, torch_dtype)
from .sources import fsdp1_view, is_hf_source
from .load import finish_load, plan_buffers
from .model import clean_name, unsaved_values


def fsdp1_units(model: nn.Module):
    """[(unit FQN, FSDP module, handle)] of the FSDP1 units that hold a FlatParameter."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return []
    units = []
    for name, m in model.named_modules():
        if isinstance(m, FSDP) and getattr(m, "_handle", None) is not None:
            units.append((clean_name(name), m, m._handle))
    return units


def live_flat(handle) -> dict:
    """The live FlatParameter's layout, in the terms of the rank file's `flat` object."""
    fp = handle.flat_param
    fqns, shapes = list(fp._fqns), [list(s) for s in fp._shapes]
    numels, mask = list(fp._numels_with_padding), list(fp._is_padding_mask)
    params, offset, k = [], 0, 0
    for n, is_pad in zip(numels, mask):
        if not is_pad:
            params.append({"fqn": clean_name(fqns[k]), "shape": shapes[k], "offset": offset})
            k += 1
        offset += n
    return {"params": params, "numel": int(fp._unpadded_unsharded_size.numel()),
            "aligned_numel": int(handle._aligned_numel), "world_size": int(handle.world_size),
            "rank": int(handle.rank), "local_numel": int(fp.numel()),
            "shard_numel_padded": int(fp._shard_numel_padded), "dtype": fp.dtype}


def flat_difference(unit: str, live: dict, e, world_size: int) -> Optional[str]:
    """Why the live unit's FlatParameter (live_flat) differs from the file's entry `e`
    (a TensorInfo with a flat object), or None when they agree."""
    if e is None or e.flat is None:
        return f"unit {unit or '(root)'} is not in the file"
    f = e.flat
    want = [{"fqn": p.fqn, "shape": list(p.shape), "offset": p.offset} for p in f.params]
    if want != live["params"]:
        untied = [p["fqn"] for p in live["params"] if p["fqn"] in set(f.shared)]
        if untied:
            return (f"unit {unit or '(root)'}: {untied[0]} is a parameter of its own in the model but "
                    "tied (shared) in the file: the param_init_fn untied it (nn.Module.to_empty "
                    "does); build FSDP with param_init_fn=reshard.fsdp1_param_init_fn(device)")
        for i, (a, b) in enumerate(zip(want, live["params"])):
            if a != b:
                return (f"unit {unit or '(root)'}: parameter {i} is {b['fqn']} {b['shape']} at flat "
                        f"offset {b['offset']} in the model, {a['fqn']} {a['shape']} at {a['offset']} "
                        "in the file")
        return (f"unit {unit or '(root)'}: {len(live['params'])} parameters in the model, "
                f"{len(want)} in the file")
    if f.numel != live["numel"]:
        return f"unit {unit or '(root)'}: flat numel {live['numel']} in the model, {f.numel} in the file"
    if f.aligned_numel != live["aligned_numel"]:
        return (f"unit {unit or '(root)'}: alignment {live['aligned_numel']} elements in the model, "
                f"{f.aligned_numel} in the file (use_orig_params / param_dtype differ)")
    c = -(-f.numel // world_size)
    if live["local_numel"] != c:
        return (f"unit {unit or '(root)'}: the local shard has {live['local_numel']} elements, the "
                f"file {c}; the FlatParameter is not sharded (call load before the first forward, "
                "outside summon_full_params)")
    start, end = e.shard
    if live["shard_numel_padded"] != c - (end - start):
        return f"unit {unit or '(root)'}: shard padding differs"
    return None


def fsdp1_convert_command(out: str, model: nn.Module, units, live_dtype) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    classes = sorted({type(m.module).__name__ for u, m, _ in units if u != ""} |
                     {type(m.module).__name__ for n, m in model.named_modules()
                      if isinstance(m, FSDP) and clean_name(n) != "" and m._handle is None})
    root = units[0][1] if units else model
    if not classes:  # the root alone is the one unit: --wrap its class (the default would wrap more)
        inner = getattr(root, "module", root)
        classes = [type(getattr(inner, "_fsdp_wrapped_module", inner)).__name__]
    cmd = (f"reshard convert <checkpoint> -o {out} --world-size {units[0][2].world_size} --layout fsdp1")
    cmd += "".join(f" --wrap {c}" for c in classes)
    if getattr(root, "_use_orig_params", False):
        cmd += " --use-orig-params"
        mp = getattr(units[0][2], "_fwd_bwd_param_dtype", None)
        if mp is not None and mp != units[0][2]._orig_param_dtype and mp in POLICY_NAMES:
            cmd += f" --param-dtype {POLICY_NAMES[mp]}"
    if live_dtype in POLICY_NAMES:
        cmd += f" --dtype {POLICY_NAMES[live_dtype]}"
    return cmd


def load_fsdp1(model: nn.Module, out: str, units, *, threads, verify, io, strict_buffers) -> LoadReport:
    """Loads an FSDP1 model: every unit's local flat shard (padding included) from the rank file
    of the fsdp1 layout whose units match the live FlatParameters (FQNs, shapes, offsets with
    padding, flat numel, alignment, world size), the shard coordinate being the handle's rank
    in its shard group (HYBRID_SHARD: within the replica)."""
    lives = [(u, m, h, live_flat(h)) for u, m, h in units]
    world_size, coord = lives[0][3]["world_size"], lives[0][3]["rank"]
    dtypes = {lv["dtype"] for *_, lv in lives}
    live_dtype = dtypes.pop() if len(dtypes) == 1 else None
    command = fsdp1_convert_command(out, model, units, live_dtype)
    layouts = {} if is_hf_source(out) else require_manifest(out, command).get("layouts", {})
    policy = POLICY_NAMES.get(live_dtype)
    candidates = layouts_of_kind({"layouts": layouts}, "fsdp1", world_size)
    candidates.sort(key=lambda k: (layouts[k].get("dtype") != policy, layouts[k].get("dtype") != "keep", k))
    chosen, reasons = None, []
    for key in candidates:
        path = layout_rank_file(out, key, coord, world_size, {"layouts": layouts})
        if not os.path.exists(path):
            reasons.append(f"{key}: {path} is missing (convert with --ranks {coord}-{coord})")
            continue
        rank_file = open_rank_file(path)
        entries = {t.name: t for t in rank_file.tensors}
        if rank_file.rank != coord or rank_file.world_size != world_size:
            reasons.append(f"{path}: holds rank {rank_file.rank} of {rank_file.world_size}")
            continue
        rank_file.check_listed(out, key, coord)  # the file OUT/reshard.json lists
        diff = None
        for u, _, _, lv in lives:
            diff = flat_difference(u, lv, entries.get(flat_entry_name(u)), world_size)
            if diff:
                break
        live_units = {flat_entry_name(u) for u, *_ in lives}
        extra = [n for n, e in entries.items() if e.flat is not None and n not in live_units]
        if diff is None and extra:
            diff = f"the file has unit(s) the model lacks: {', '.join(extra[:4])}"
        if diff:
            reasons.append(f"{key}: {diff}")
            continue
        chosen = (key, rank_file, entries)
        break
    source = "rank file"
    if chosen is None:
        view = fsdp1_view(out, model, world_size, coord, live_dtype)
        if view is not None:
            entries = {t.name: t for t in view.reader.tensors}
            diff = next((d for u, _, _, lv in lives
                         if (d := flat_difference(u, lv, entries.get(flat_entry_name(u)), world_size))), None)
            if diff is None:
                chosen, source = (view.key, view.reader, entries), view.source
            else:
                reasons.append(f"{view.source}: {diff}")
    if chosen is None:
        have = "; ".join(reasons) if reasons else (
            f"no fsdp1 layout for world size {world_size} (layouts: {', '.join(sorted(layouts)) or 'none'})")
        raise LayoutMismatchError(f"{out}: no layout matches this FSDP1 job ({have}). Create one with: {command}")
    key, rank_file, entries = chosen
    path = rank_file.path

    direct, converted = [], []
    device_index = None
    for u, m, h, lv in lives:
        e = entries[flat_entry_name(u)]
        fp = h.flat_param
        shard = flat_local_shard(fp, lv["local_numel"])
        if shard.device.type == "meta":
            raise InvalidArgumentError(f"unit {u or '(root)'}: the FlatParameter is on the meta device; "
                               "build FSDP with param_init_fn=reshard.fsdp1_param_init_fn(device)")
        on_device, device_index = target_device(shard, f"unit {u or '(root)'}", device_index)
        if torch_dtype(e.dtype) == shard.dtype:
            direct.append(target(e.name, shard, e.nbytes, on_device))
        else:
            converted.append((e.name, shard))
    prefix = getattr(model, "base_model_prefix", "") or ""
    used = {flat_entry_name(u) for u, *_ in lives}
    buffers, needs_fresh = plan_buffers(model, entries, prefix, path, used)
    report = finish_load(model, rank_file, key, world_size, coord, entries, direct, converted,
                         buffers, needs_fresh, device_index, threads=threads, verify=verify, io=io,
                         strict_buffers=strict_buffers, source=source)
    fill_unsaved_flat(model, lives, entries, coord)
    # A tied parameter in two units (without use_orig_params each unit has its own copy, filled
    # from the one checkpoint tensor: formats/model-manifest.md).
    first: Dict[str, str] = {}
    untied = []
    for u, *_ in lives:
        for p in entries[flat_entry_name(u)].flat.params:
            if not p.key:
                continue  # computed by the model (fill_unsaved_flat)
            full = f"{u}.{p.fqn}" if u else p.fqn
            if p.key in first:
                untied.append((full, first[p.key]))
            else:
                first[p.key] = full
    if untied:
        report.untied = [f"{a} = {b}" for a, b in untied]
        model._reshard_untied = dict(untied)  # for check_weights
        warnings.warn(
            f"{len(untied)} tied parameter pair(s) are two parameters in this FSDP1 model "
            f"({'; '.join(report.untied[:4])}): their modules are in different units. Both were loaded "
            "with the checkpoint's values, but training updates them separately; to keep them tied, "
            "wrap the modules holding both names in one unit, or use use_orig_params=True", stacklevel=3)
    return report


def fill_unsaved_flat(model: nn.Module, lives, entries, coord: int) -> None:
    """Writes the parameters the model never saves (flat params whose key is "": the rank file
    holds zeros there, formats/rank-file.md) into this rank's part of their flat shards, with
    the values from_pretrained computes for them (reshard.model.unsaved_values)."""
    todo = [(u, h, lv, p) for u, _m, h, lv in lives
            for p in entries[flat_entry_name(u)].flat.params if not p.key]
    if not todo:
        return
    values = unsaved_values(model)
    with torch.no_grad():
        for u, h, lv, p in todo:
            name = clean_name(f"{u}.{p.fqn}" if u else p.fqn)
            v = values.get(name)
            if v is None or list(v.shape) != list(p.shape):
                raise LayoutMismatchError(
                    f"unit {u or '(root)'}: parameter {name} is not in the checkpoint, and the model does "
                    "not compute it as from_pretrained would (it is not one of its _keys_to_ignore_on_save)")
            c = lv["local_numel"]
            shard = flat_local_shard(h.flat_param, c)
            lo = coord * c
            a, b = max(lo, p.offset), min(lo + c, p.offset + p.numel)
            if a < b:
                shard[a - lo:b - lo].copy_(v.reshape(-1)[a - p.offset:b - p.offset].to(shard.dtype))


def fsdp1_param_init_fn(device):
    """A param_init_fn for FullyShardedDataParallel over a meta-device model that allocates each
    module's own parameters and buffers (uninitialised, as `to_empty(recurse=False)`) on
    `device` while keeping tied parameters tied: FSDP1 materialises module by module, and
    to_empty would give `lm_head` and `embed_tokens` separate tensors. Values come from
    reshard.load afterwards."""
    import weakref

    device = torch.device(device)
    if device.type == "cuda":
        prepare_quietly(device)
    # id(meta parameter) -> (the meta parameter, kept alive so that its id stays unique; a weak
    # reference to its materialised parameter: FSDP frees it once flattened, and a strong one
    # here would keep every unit's unsharded parameters alive).
    memo: Dict[int, Tuple[nn.Parameter, "weakref.ref"]] = {}

    def init(module: nn.Module) -> nn.Module:
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            hit = memo.get(id(p))
            new = hit[1]() if hit is not None else None
            if new is None:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                memo[id(p)] = (p, weakref.ref(new))
            module._parameters[name] = new
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
        return module  # as nn.Module.to_empty does (accelerate's tie wrapper uses it)

    return init


def flat_local_shard(fp, numel: int) -> torch.Tensor:
    """A FlatParameter's local shard of `numel` elements: `_local_shard` (there also while a
    unit stays unsharded after a forward), else its data (before the first forward)."""
    t = getattr(fp, "_local_shard", None)
    return t if t is not None and t.numel() == numel else fp.data


# ---- the live job's fsdp1 layout (reshard.save, reshard.load_optimizer) -----------------------

@dataclasses.dataclass
class Fsdp1Job:
    """What a save of an FSDP1 model writes: the layout `reshard convert --layout fsdp1` would
    give this job, and its units in construction order."""
    units: List[Tuple[str, Any, Any]]  # (unit FQN, FSDP module, FlatParamHandle), post-order
    world: int                          # shard group size (HYBRID_SHARD: within a replica)
    coord: int                          # this rank's shard coordinate
    wrap: List[str]
    use_orig_params: bool
    param_dtype: str                    # "" unless use_orig_params with MixedPrecision.param_dtype
    key: str

    @property
    def fsdp1(self) -> Tuple[List[str], bool, str]:
        return (self.wrap, self.use_orig_params, self.param_dtype)


def unwrap(module: nn.Module) -> nn.Module:
    """The module an activation-checkpoint wrapper wraps (itself otherwise)."""
    while hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


def fsdp1_job(model: nn.Module, what: str) -> Optional[Fsdp1Job]:
    """The FSDP1 layout of `model`, or None when it has no FSDP1 unit. Raises ReshardError when
    the job is one that no fsdp1 layout describes (no FSDP root, units not chosen by module
    class, parameters outside every FlatParameter, NO_SHARD on several ranks, units sharded
    over different groups)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


    if not fsdp1_units(model):
        return None
    if not isinstance(model, FSDP):
        raise UnsupportedError(f"{what}: the model's root is a {type(model).__name__}, not "
                           "FullyShardedDataParallel; fsdp1 layouts always have the root as a unit "
                           "(wrap the whole model, with an auto_wrap_policy for the inner units)")
    # Units in construction order (FSDP1 wraps children before parents: post-order), as
    # `reshard convert --layout fsdp1` writes them.
    units: List[Tuple[str, Any, Any]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name)
        if isinstance(m, FSDP) and m._handle is not None:
            units.append((clean_name(prefix), m, m._handle))

    visit(model, "")
    fsdp_modules = [(clean_name(n), m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    wrap = sorted({type(unwrap(m.module)).__name__ for n, m in fsdp_modules if n != ""})
    wrapped = {id(unwrap(m.module)) for _, m in fsdp_modules}
    for n, m in model.named_modules():
        if type(m).__name__ in wrap and id(m) not in wrapped:
            raise UnsupportedError(
                f"{what}: module {clean_name(n)} ({type(m).__name__}) is not an FSDP unit, while "
                f"other {type(m).__name__} modules are; fsdp1 layouts describe wrapping by module "
                "class (ModuleWrapPolicy / transformer_auto_wrap_policy), every module of a wrapped "
                "class being a unit")
    use_orig = bool(getattr(model, "_use_orig_params", False))
    first = units[0][2]
    world, coord = int(first.world_size), int(first.rank)
    param_dtype = ""
    if use_orig:  # as fsdp1_convert_command maps MixedPrecision.param_dtype to --param-dtype
        mp = getattr(first, "_fwd_bwd_param_dtype", None)
        if mp is not None and mp != first._orig_param_dtype and mp in POLICY_NAMES:
            param_dtype = POLICY_NAMES[mp]
    for u, m, h in units:
        label = u or "(root)"
        if (int(h.world_size), int(h.rank)) != (world, coord):
            raise UnsupportedError(f"{what}: unit {label} is sharded as rank {h.rank} of {h.world_size}, "
                               f"unit {units[0][0] or '(root)'} as rank {coord} of {world}: one "
                               "sharding group for every unit is needed")
        if bool(h._use_orig_params) != use_orig:
            raise UnsupportedError(f"{what}: unit {label} has use_orig_params={h._use_orig_params}, the "
                               f"root {use_orig}")
        if not h.uses_sharded_strategy and h.world_size > 1:
            raise UnsupportedError(
                f"{what}: unit {label} uses ShardingStrategy.NO_SHARD on {h.world_size} ranks: each "
                "rank holds the whole FlatParameter, which no fsdp1 layout describes (a layout of "
                f"world size {h.world_size} gives each rank 1/{h.world_size} of it); save from "
                "FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, or from world size 1")
    covered = set()
    for u, _, h in units:
        fp = h.flat_param
        for f in list(fp._fqns) + [f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name
                                   for s in fp._shared_param_infos]:
            covered.add(clean_name(f"{u}.{f}" if u else f))
    for n, p in model.named_parameters():
        if use_orig and clean_name(n) in covered:
            continue
        if not use_orig and hasattr(p, "_unpadded_unsharded_size"):  # a FlatParameter
            continue
        raise UnsupportedError(f"{what}: parameter {clean_name(n)} is in no FlatParameter (ignored by "
                           "FSDP?); fsdp1 layouts hold every parameter in some unit")
    key = layout_key(world, (wrap, use_orig, param_dtype))
    return Fsdp1Job(units=units, world=world, coord=coord, wrap=wrap, use_orig_params=use_orig,
                    param_dtype=param_dtype, key=key)


def flat_object(unit: str, handle):
    """The unit's `flat` object for a save (a FlatInfo: unit, numel, aligned_numel, params
    (fqn, key, shape, offset), shared), as `reshard convert` plans it (formats/rank-file.md, FSDP1 layouts):
    paths relative to the unit without wrapper parts, `key` the parameter's name in the model's
    state dict (what `reshard export` writes it as), offsets counting the padding."""
    live = live_flat(handle)
    params = [(p["fqn"], clean_name(f"{unit}.{p['fqn']}" if unit else p["fqn"]),
               [int(d) for d in p["shape"]], int(p["offset"])) for p in live["params"]]
    shared = [clean_name(f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name)
              for s in handle.flat_param._shared_param_infos]
    return flat_info(unit, live["numel"], live["aligned_numel"], params, shared)


def fsdp1_local_shard(unit: str, handle, world: int) -> torch.Tensor:
    """The unit's local flat shard, padding included: the FlatParameter's sharded data (outside
    forward/backward the same as `flat_param.data`; `_local_shard` also while a unit stays
    unsharded after a forward)."""
    fp = handle.flat_param
    if handle._use_orig_params:
        # Parameters whose storage was replaced (not updated in place) go back into the
        # FlatParameter first, as FSDP does before its next unshard (a no-op while unsharded).
        handle._writeback_orig_params()
    c = -(-int(fp._unpadded_unsharded_size.numel()) // world)
    t = flat_local_shard(fp, c)
    if t.numel() != c or t.dim() != 1:
        raise InvalidArgumentError(
            f"{flat_entry_name(unit)}: the local flat shard has shape {list(t.shape)}, expected "
            f"[{c}] (ceil({fp._unpadded_unsharded_size.numel()} / {world})); save outside "
            "summon_full_params and between steps")
    return t.detach()
