"""Saving a live (FSDP2, FSDP1 or plain) model, and optionally its optimizer, as a reshard
output directory that ``reshard.load`` and ``reshard verify`` accept: the save half of a
training checkpoint.

    reshard.save(model, OUT, optimizer=opt, step=step)       # collective: call on every rank
    ...
    model = reshard.empty_model(OUT); fully_shard(...); model.to_empty(device=...)
    reshard.load(model, OUT)
    opt = torch.optim.AdamW(model.parameters(), ...)
    reshard.load_optimizer(opt, model, OUT)

Every rank writes its own rank file from its own shards (``to_local()``), straight from host
memory or through a bounded pinned staging buffer from the GPU; nothing goes through rank 0.
Rank 0 writes the manifest only after every rank has committed its file, so a checkpoint
whose save was interrupted has no ``reshard.json`` and does not load or verify.

FSDP1 (``FullyShardedDataParallel``): the job's own fsdp1 layout is written, with the key and
header that ``reshard convert --layout fsdp1`` gives the job's wrap classes, use_orig_params
and MixedPrecision.param_dtype (dtype policy ``keep``): one entry per unit holding the rank's
local flat shard as it is (padding included), the same ``flat`` objects as a conversion, then
the persistent buffers whole. Saving right after loading a conversion gives its rank files
back byte for byte. Build the new job as for a conversion (``param_init_fn=
reshard.fsdp1_param_init_fn(device)``) and load with ``reshard.load``. Optimizer state is
stored per rank as it is ("local" tensors: the state of the local flat shard, or of the
original parameters' local views under use_orig_params) and restores into the same layout
only. HYBRID_SHARD: one replica writes; NO_SHARD: only at world size 1.

formats/manifest.md (*Saved checkpoints*) and formats/rank-file.md (``source.saved``)
describe what is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import _C
from ._C import ReshardError
from .api import _default_threads, _local, _shard_coordinate
from .format import _TORCH_DTYPE_NAMES, chunk_rows

OPTIM_DIR = "optim"
OPTIM_JSON = "optimizer.json"
OPTIM_SEP = "#"  # optimizer tensor names: "<parameter name>#<state key>"
MODEL_MANIFEST = "reshard-model.json"  # formats/model-manifest.md

# Test hook: seconds to sleep before each tensor of a rank file (interrupt a save mid-write).
_PAUSE_ENV = "RESHARD_TEST_SAVE_PAUSE"


@dataclasses.dataclass
class SaveReport:
    out: str
    layout: str
    rank: int                 # shard coordinate
    world_size: int
    wrote: bool               # False on HSDP replicas other than 0 (they write nothing)
    file: Optional[str]
    optimizer_file: Optional[str]
    bytes: int
    seconds: float
    staging_bytes: int
    save_id: str              # hex16 of the saved source's id


def _safetensors_dtype(dtype: torch.dtype) -> str:
    for name, attr in _TORCH_DTYPE_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    raise ReshardError(f"dtype {dtype} has no safetensors name; reshard cannot save it")


def _replica_index(model: nn.Module) -> int:
    """0 on the replica that writes: the first replica of each shard coordinate under HSDP,
    global rank 0 for a plain module in a multi-process job, always 0 without a process group."""
    from torch.distributed.tensor import DTensor

    for _, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            shard_dim = next(i for i, pl in enumerate(p.placements) if pl.is_shard())
            index = 0
            for d in range(mesh.ndim):
                if d != shard_dim:
                    index = index * mesh.size(d) + mesh.get_local_rank(d)
            return index
        break
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class _Group:
    """The collectives save needs; no-ops without a process group (one process)."""

    def __init__(self):
        dist = torch.distributed
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.on else 0

    def broadcast(self, obj):
        if not self.on:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> List[Any]:
        if not self.on:
            return [obj]
        objs: List[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(objs, obj)
        return objs


def _raise_first(errs: List[Optional[str]], what: str) -> None:
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        r, e = bad[0]
        more = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        raise ReshardError(f"{what} failed on rank {r}{more}: {e}")


def _entry(name: str, t: torch.Tensor, global_shape: List[int], world: int, coord: int,
           sharded_like_param: bool) -> Tuple[tuple, torch.Tensor]:
    """One `_C.save` tensor tuple for local tensor `t` (kept alive by the caller), sharded by
    the FSDP2 rule."""
    if len(global_shape) == 0:
        sharded, start, end = False, 0, 0
    else:
        start, end = chunk_rows(global_shape[0], world, coord)
        sharded = True
        if not sharded_like_param:  # a whole tensor on every rank: take this rank's rows
            t = t[start:end]
        if list(t.shape) != [end - start] + list(global_shape[1:]):
            raise ReshardError(
                f"{name}: local shape {list(t.shape)}, but rows [{start}, {end}) of global shape "
                f"{global_shape} by the FSDP2 chunk rule for shard {coord} of {world}: reshard "
                "saves FSDP2 layouts (fully_shard on dim 0)")
    return _raw_entry(name, t, global_shape, sharded, start, end)


def _model_entries(model: nn.Module, world: int, coord: int):
    from torch.distributed.tensor import DTensor

    entries, keep = [], []
    for name, p in model.named_parameters():
        is_d = isinstance(p, DTensor)
        e, t = _entry(name, _local(p).detach(), list(p.shape), world, coord,
                      sharded_like_param=is_d or world == 1)
        entries.append(e)
        keep.append(t)
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in persistent:
            e, t = _entry(name, b.detach(), list(b.shape), world, coord, sharded_like_param=world == 1)
            entries.append(e)
            keep.append(t)
    return entries, keep


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(type(v).__name__)


def _param_names(model: nn.Module, fsdp1: bool) -> Dict[str, torch.Tensor]:
    """name → parameter, names as model.named_parameters() gives them (for FSDP1 without the
    wrapper parts: "model.layers.0._flat_param", or the original parameters' names)."""
    from .api import _clean_name

    return {(_clean_name(n) if fsdp1 else n): p for n, p in model.named_parameters()}


def _optimizer_entries(optimizer, model: nn.Module, world: int, coord: int, fsdp1: bool = False):
    from torch.distributed.tensor import DTensor

    params = _param_names(model, fsdp1)
    names = {id(p): n for n, p in params.items()}
    entries, keep, state_desc = [], [], {}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        gnames = []
        for p in g["params"]:
            if id(p) not in names:
                raise ReshardError(f"optimizer param_groups[{gi}] holds a tensor that is not a "
                                   "parameter of the model")
            gnames.append(names[id(p)])
        hyper = {}
        for k, v in g.items():
            if k == "params":
                continue
            try:
                hyper[k] = _jsonable(v)
            except TypeError:
                raise ReshardError(f"optimizer param_groups[{gi}][{k!r}] is a {type(v).__name__}; "
                                   "reshard saves JSON-like hyper-parameters only") from None
        groups.append({"params": gnames, **hyper})
    for p, st in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            raise ReshardError("optimizer state for a tensor that is not a parameter of the model")
        desc = {"tensors": {}, "scalars": {}}
        for k, v in sorted(st.items()):
            if not isinstance(v, torch.Tensor):
                try:
                    desc["scalars"][k] = _jsonable(v)
                except TypeError:
                    raise ReshardError(f"optimizer state {name}[{k!r}] is a {type(v).__name__}; "
                                       "reshard saves tensors and JSON-like values only") from None
                continue
            full_shape = list(v.shape)
            if v.dim() == 0:
                kind = "whole"
                e, t = _entry(f"{name}{OPTIM_SEP}{k}", v.detach(), [], world, coord, True)
            elif fsdp1:
                # FSDP1: state of this rank's local flat shard or original-parameter view, kept
                # as it is (stored whole); it fits only this layout's same shard coordinate.
                if full_shape != list(params[name].shape):
                    raise ReshardError(
                        f"optimizer state {name}[{k!r}] has shape {full_shape}, its parameter "
                        f"{list(params[name].shape)} on this rank; reshard saves FSDP1 state shaped "
                        "like its local parameter, or 0-dim (load_optimizer could not restore it)")
                kind = "local"
                e, t = _raw_entry(f"{name}{OPTIM_SEP}{k}", v.detach(), full_shape, False, 0, 0)
            elif full_shape == list(params[name].shape):
                kind = "sharded"
                local = v.to_local() if isinstance(v, DTensor) else v
                e, t = _entry(f"{name}{OPTIM_SEP}{k}", local.detach(), full_shape, world, coord,
                              sharded_like_param=isinstance(v, DTensor) or world == 1)
            else:
                raise ReshardError(f"optimizer state {name}[{k!r}] has shape {full_shape}; reshard "
                                   "saves state shaped like its parameter, or 0-dim")
            desc["tensors"][k] = kind
            entries.append(e)
            keep.append(t)
        state_desc[name] = desc
    meta = {"format": "reshard.optimizer", "format_version": 1,
            "class": type(optimizer).__name__, "param_groups": groups, "state": state_desc}
    return entries, keep, meta


def _fsync_dir(d: str) -> None:
    """Makes a rename inside `d` durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data) -> None:
    """Writes `data` (str or bytes) to `path` through a synced temporary and a rename."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".tmp-")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(d)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _copy_aux(model: nn.Module, source: Optional[str], out: str) -> List[str]:
    """config/tokenizer files: those listed by the source's manifest when SOURCE is a reshard
    output directory (a checkpoint loaded with reshard.load), else config.json (and
    generation_config.json) written from the model."""
    names: List[str] = []
    if source and os.path.exists(os.path.join(source, "reshard.json")):
        with open(os.path.join(source, "reshard.json")) as f:
            names = [a for a in json.load(f).get("aux_files", [])
                     if os.path.exists(os.path.join(source, a))]
        # The model manifest (fsdp1 layouts are planned from it) comes along even when SOURCE
        # lists it not (it holds only fsdp2 layouts): `reshard export` of OUT passes it on, so
        # the export converts into fsdp1 layouts directly.
        if MODEL_MANIFEST not in names and os.path.exists(os.path.join(source, MODEL_MANIFEST)):
            names.append(MODEL_MANIFEST)
        for a in names:
            with open(os.path.join(source, a), "rb") as f:
                _write_atomic(os.path.join(out, a), f.read())
    elif source:
        raise ReshardError(f"source {source}: no reshard.json; pass the reshard output directory "
                           "the model was loaded from (or source=None)")
    if "config.json" not in names and getattr(model, "config", None) is not None:
        _write_atomic(os.path.join(out, "config.json"), model.config.to_json_string())
        names.append("config.json")
        gen = getattr(model, "generation_config", None)
        if gen is not None and "generation_config.json" not in names:
            try:
                _write_atomic(os.path.join(out, "generation_config.json"), gen.to_json_string())
                names.append("generation_config.json")
            except Exception:  # a generation config that cannot be serialized is not essential
                pass
    return names


def _check_optimizer_files(out: str, key: str, world: int, save_id: int, step) -> None:
    """Before the manifest commits the save: every optimizer rank file is there, valid
    (preamble and header), and of this save."""
    want = {"id": f"{save_id:016x}", "step": step}
    for r in range(world):
        path = os.path.join(out, key, OPTIM_DIR, f"rank-{r:05d}-of-{world:05d}.reshard")
        if not os.path.exists(path):
            raise ReshardError(f"{path}: missing; the optimizer state of shard {r} was not written")
        h = json.loads(_C.read_header(path))
        if h["source"].get("saved") != want or h["rank"] != r or h["layout"]["key"] != key:
            raise ReshardError(f"{path}: not rank {r} of this save ({want}); found rank {h['rank']} "
                               f"of {h['layout']['key']}, source {h['source'].get('saved')}")
    if not os.path.exists(os.path.join(out, key, OPTIM_DIR, OPTIM_JSON)):
        raise ReshardError(f"{os.path.join(out, key, OPTIM_DIR, OPTIM_JSON)}: missing")


# ---- FSDP1 (FullyShardedDataParallel, FlatParameter) -----------------------------------------

@dataclasses.dataclass
class _Fsdp1Job:
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


def _unwrap(module: nn.Module) -> nn.Module:
    """The module an activation-checkpoint wrapper wraps (itself otherwise)."""
    while hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


def _fsdp1_job(model: nn.Module, what: str) -> Optional[_Fsdp1Job]:
    """The FSDP1 layout of `model`, or None when it has no FSDP1 unit. Raises ReshardError when
    the job is one that no fsdp1 layout describes (no FSDP root, units not chosen by module
    class, parameters outside every FlatParameter, NO_SHARD on several ranks, units sharded
    over different groups)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from .api import _POLICY_NAMES, _clean_name, _fsdp1_units

    if not _fsdp1_units(model):
        return None
    if not isinstance(model, FSDP):
        raise ReshardError(f"{what}: the model's root is a {type(model).__name__}, not "
                           "FullyShardedDataParallel; fsdp1 layouts always have the root as a unit "
                           "(wrap the whole model, with an auto_wrap_policy for the inner units)")
    # Units in construction order (FSDP1 wraps children before parents: post-order), as
    # `reshard convert --layout fsdp1` writes them.
    units: List[Tuple[str, Any, Any]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name)
        if isinstance(m, FSDP) and m._handle is not None:
            units.append((_clean_name(prefix), m, m._handle))

    visit(model, "")
    fsdp_modules = [(_clean_name(n), m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    wrap = sorted({type(_unwrap(m.module)).__name__ for n, m in fsdp_modules if n != ""})
    wrapped = {id(_unwrap(m.module)) for _, m in fsdp_modules}
    for n, m in model.named_modules():
        if type(m).__name__ in wrap and id(m) not in wrapped:
            raise ReshardError(
                f"{what}: module {_clean_name(n)} ({type(m).__name__}) is not an FSDP unit, while "
                f"other {type(m).__name__} modules are; fsdp1 layouts describe wrapping by module "
                "class (ModuleWrapPolicy / transformer_auto_wrap_policy), every module of a wrapped "
                "class being a unit")
    use_orig = bool(getattr(model, "_use_orig_params", False))
    first = units[0][2]
    world, coord = int(first.world_size), int(first.rank)
    param_dtype = ""
    if use_orig:  # as _fsdp1_convert_command maps MixedPrecision.param_dtype to --param-dtype
        mp = getattr(first, "_fwd_bwd_param_dtype", None)
        if mp is not None and mp != first._orig_param_dtype and mp in _POLICY_NAMES:
            param_dtype = _POLICY_NAMES[mp]
    for u, m, h in units:
        label = u or "(root)"
        if (int(h.world_size), int(h.rank)) != (world, coord):
            raise ReshardError(f"{what}: unit {label} is sharded as rank {h.rank} of {h.world_size}, "
                               f"unit {units[0][0] or '(root)'} as rank {coord} of {world}: one "
                               "sharding group for every unit is needed")
        if bool(h._use_orig_params) != use_orig:
            raise ReshardError(f"{what}: unit {label} has use_orig_params={h._use_orig_params}, the "
                               f"root {use_orig}")
        if not h.uses_sharded_strategy and h.world_size > 1:
            raise ReshardError(
                f"{what}: unit {label} uses ShardingStrategy.NO_SHARD on {h.world_size} ranks: each "
                "rank holds the whole FlatParameter, which no fsdp1 layout describes (a layout of "
                f"world size {h.world_size} gives each rank 1/{h.world_size} of it); save from "
                "FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, or from world size 1")
    covered = set()
    for u, _, h in units:
        fp = h.flat_param
        for f in list(fp._fqns) + [f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name
                                   for s in fp._shared_param_infos]:
            covered.add(_clean_name(f"{u}.{f}" if u else f))
    for n, p in model.named_parameters():
        if use_orig and _clean_name(n) in covered:
            continue
        if not use_orig and hasattr(p, "_unpadded_unsharded_size"):  # a FlatParameter
            continue
        raise ReshardError(f"{what}: parameter {_clean_name(n)} is in no FlatParameter (ignored by "
                           "FSDP?); fsdp1 layouts hold every parameter in some unit")
    key = _C.layout_key(world, (wrap, use_orig, param_dtype))
    return _Fsdp1Job(units=units, world=world, coord=coord, wrap=wrap, use_orig_params=use_orig,
                     param_dtype=param_dtype, key=key)


def _flat_object(unit: str, handle) -> tuple:
    """The unit's `flat` object for `_C.save`: (unit, numel, aligned_numel, [(fqn, key, shape,
    offset)], shared), as `reshard convert` plans it (formats/rank-file.md, FSDP1 layouts):
    paths relative to the unit without wrapper parts, `key` the parameter's name in the model's
    state dict (what `reshard export` writes it as), offsets counting the padding."""
    from .api import _clean_name, _live_flat

    live = _live_flat(handle)
    params = [(p["fqn"], _clean_name(f"{unit}.{p['fqn']}" if unit else p["fqn"]),
               [int(d) for d in p["shape"]], int(p["offset"])) for p in live["params"]]
    shared = [_clean_name(f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name)
              for s in handle.flat_param._shared_param_infos]
    return (unit, live["numel"], live["aligned_numel"], params, shared)


def _fsdp1_local_shard(unit: str, handle, world: int) -> torch.Tensor:
    """The unit's local flat shard, padding included: the FlatParameter's sharded data (outside
    forward/backward the same as `flat_param.data`; `_local_shard` also while a unit stays
    unsharded after a forward)."""
    from .api import _flat_entry_name, _flat_local_shard

    fp = handle.flat_param
    if handle._use_orig_params:
        # Parameters whose storage was replaced (not updated in place) go back into the
        # FlatParameter first, as FSDP does before its next unshard (a no-op while unsharded).
        handle._writeback_orig_params()
    c = -(-int(fp._unpadded_unsharded_size.numel()) // world)
    t = _flat_local_shard(fp, c)
    if t.numel() != c or t.dim() != 1:
        raise ReshardError(
            f"{_flat_entry_name(unit)}: the local flat shard has shape {list(t.shape)}, expected "
            f"[{c}] (ceil({fp._unpadded_unsharded_size.numel()} / {world})); save outside "
            "summon_full_params and between steps")
    return t.detach()


def _fsdp1_model_entries(model: nn.Module, job: _Fsdp1Job):
    """One flat entry per unit (the local shard, padding included), in construction order, then
    the persistent buffers whole: the entries `reshard convert --layout fsdp1` writes."""
    from .api import _clean_name, _flat_entry_name, _persistent_buffer_names

    entries, keep, flat = [], [], {}
    for u, _, h in job.units:
        name = _flat_entry_name(u)
        t = _fsdp1_local_shard(u, h, job.world)
        obj = _flat_object(u, h)
        start, end = chunk_rows(obj[1], job.world, job.coord)
        e, t = _raw_entry(name, t, [obj[1]], True, start, end)
        entries.append(e)
        keep.append(t)
        flat[name] = obj
    persistent = _persistent_buffer_names(model)
    # FSDP1 MixedPrecision(buffer_dtype=...) casts buffers in place; like FSDP's own
    # state_dict, save them in the dtype they had (the root FSDP state records it).
    orig_dtypes = getattr(model, "_buffer_name_to_orig_dtype", None) or {}
    seen = set()
    for n, b in model.named_buffers():
        n = _clean_name(n)
        if n in persistent and n not in seen:
            seen.add(n)
            t = b.detach()
            want = orig_dtypes.get(n)
            if want is not None and t.is_floating_point() and t.dtype != want:
                t = t.to(want)
            e, t = _raw_entry(n, t, list(b.shape), False, 0, 0)
            entries.append(e)
            keep.append(t)
    return entries, keep, flat


def _raw_entry(name: str, t: torch.Tensor, global_shape: List[int], sharded: bool, start: int,
               end: int) -> Tuple[tuple, torch.Tensor]:
    """A `_C.save` tensor tuple for `t` stored as it is (the caller has checked its shape)."""
    if t.device.type == "meta":
        raise ReshardError(f"{name} is on the meta device: nothing to save")
    if t.device.type not in ("cpu", "cuda"):
        raise ReshardError(f"{name} is on {t.device}; reshard saves from CUDA or CPU")
    if not t.is_contiguous():
        t = t.contiguous()
    return ((name, _safetensors_dtype(t.dtype), list(global_shape), sharded, start, end,
             t.data_ptr(), t.numel() * t.element_size(), t.device.type == "cuda"), t)


def _fsdp1_start(model: nn.Module, group: "_Group") -> Tuple[Optional[_Fsdp1Job], bool]:
    """Collective for FSDP1 models: (the job's FSDP1 layout, whether this process writes its
    shard coordinate's files). The first process (lowest global rank) of each coordinate
    writes (HYBRID_SHARD: one replica); every coordinate 0..W-1 must be held by a process. A
    refusal on any rank is raised on every rank. (None, False) for other models."""
    try:
        job, err = _fsdp1_job(model, "reshard.save"), None
    except ReshardError as e:
        job, err = None, str(e)
    if job is None and err is None:
        return None, False
    gathered = group.all_gather((err, job.world if job else None, job.coord if job else None))
    _raise_first([g[0] for g in gathered], "reshard.save")
    coords = [(w, c) for _, w, c in gathered]
    worlds = {w for w, _ in coords}
    if len(worlds) != 1:
        raise ReshardError(f"reshard.save: processes disagree on the shard group size ({sorted(worlds)})")
    held = {c for _, c in coords}
    if held != set(range(job.world)):
        raise ReshardError(f"reshard.save: shard coordinates {sorted(set(range(job.world)) - held)} "
                           f"of {job.world} are held by no process")
    return job, min(r for r, (_, c) in enumerate(coords) if c == job.coord) == group.rank


def save(model: nn.Module, out: str, optimizer=None, step: Optional[int] = None, *,
         source: Optional[str] = None, chunk_size: int = 2 << 20,
         staging_bytes: int = 32 << 20, verify: bool = False) -> SaveReport:
    """Saves `model` (FSDP2, FSDP1 or plain; on CUDA or CPU) as a reshard output directory OUT.

    Collective: every rank of the job calls it. Every shard coordinate's first replica writes
    OUT/KEY/rank-<coord>-of-N.reshard from its local shards, KEY being fsdp2-wsN (FSDP2 and
    plain modules) or the job's fsdp1 layout key (FullyShardedDataParallel, e.g.
    fsdp1-wsN-LlamaDecoderLayer-orig-pbf16); with `optimizer`, also
    OUT/KEY/optim/rank-<coord>-of-N.reshard (FSDP2: state tensors sharded like their
    parameters; FSDP1: this rank's state tensors as they are) and, from rank 0,
    OUT/KEY/optim/optimizer.json. Rank 0 then copies the config and tokenizer files (and
    reshard-model.json) of `source` (the reshard output directory the model was loaded from;
    else it writes the model's config.json) and writes OUT/reshard.json once every file is in
    place. OUT must not already hold a reshard.json. Raises ReshardError on every rank when
    any rank fails; then OUT holds no manifest."""
    out = os.path.abspath(out)
    group = _Group()
    job, writes = _fsdp1_start(model, group)
    if job is not None:
        world, coord, key = job.world, job.coord, job.key
    else:
        world, coord = _shard_coordinate(model)
        writes = _replica_index(model) == 0
        key = f"fsdp2-ws{world}"

    # 1. Rank 0 checks OUT, creates its directories and picks the save's id.
    msg: Any = None
    if group.rank == 0:
        try:
            if os.path.exists(os.path.join(out, "reshard.json")):
                raise ReshardError(f"{out} already holds a checkpoint (reshard.json); save into a "
                                   "new directory")
            os.makedirs(os.path.join(out, key, OPTIM_DIR) if optimizer is not None
                        else os.path.join(out, key), exist_ok=True)
            msg = ("ok", int.from_bytes(os.urandom(8), "little"))
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            msg = ("error", str(e))
    msg = group.broadcast(msg)
    if msg[0] == "error":
        raise ReshardError(msg[1])
    save_id = msg[1]

    # 2. Every writing rank writes its files.
    pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    err = None
    path = opt_path = None
    report = {"bytes": 0, "seconds": 0.0, "staging_bytes": 0}
    try:
        flat: Dict[str, tuple] = {}
        if job is not None:
            entries, keep, flat = _fsdp1_model_entries(model, job)
        else:
            entries, keep = _model_entries(model, world, coord)
        if optimizer is not None:
            opt_entries, opt_keep, meta = _optimizer_entries(optimizer, model, world, coord,
                                                             fsdp1=job is not None)
            meta["step"] = step
            meta["layout"] = key
        tensors = keep + (opt_keep if optimizer is not None else [])
        devices = {t.device.index for t in tensors if t.device.type == "cuda"}
        if len(devices) > 1:
            raise ReshardError("tensors on several CUDA devices; reshard.save expects one device per rank")
        device = devices.pop() if devices else 0
        if any(t.device.type == "cuda" for t in tensors):
            torch.cuda.synchronize(device)  # the copier's stream must see finished updates
        del tensors
        if writes:
            name = f"rank-{coord:05d}-of-{world:05d}.reshard"
            path = os.path.join(out, key, name)
            kwargs = dict(chunk_size=chunk_size, device=device, staging_bytes=staging_bytes,
                          verify=verify, pause_seconds=pause,
                          fsdp1=job.fsdp1 if job is not None else None)
            r = _C.save(path, key, world, coord, save_id, step, entries, flat=flat, **kwargs)
            for k in report:  # staging is reused: the peak, not a sum
                report[k] = max(report[k], r[k]) if k == "staging_bytes" else report[k] + r[k]
            if optimizer is not None:
                opt_path = os.path.join(out, key, OPTIM_DIR, name)
                r = _C.save(opt_path, key, world, coord, save_id, step, opt_entries, **kwargs)
                for k in report:
                    report[k] = max(report[k], r[k]) if k == "staging_bytes" else report[k] + r[k]
        del keep
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    # FSDP1 optimizer state differs between shard coordinates (use_orig_params: which views
    # have elements, hence state, on this rank): each writer sends its description to rank 0.
    mine = None
    if err is None and optimizer is not None and job is not None and writes:
        mine = (coord, meta["state"])
    outcomes = group.all_gather((err, mine))
    _raise_first([e for e, _ in outcomes], "reshard.save")

    # 3. Every file is committed: rank 0 writes the manifest, the commit point of the save.
    err = None
    if group.rank == 0:
        try:
            if optimizer is not None:
                if job is not None:
                    by_coord = {c: st for _, m in outcomes if m is not None for c, st in [m]}
                    del meta["state"]
                    meta["rank_state"] = [by_coord[c] for c in range(world)]
                _write_atomic(os.path.join(out, key, OPTIM_DIR, OPTIM_JSON), json.dumps(meta, indent=1))
                _check_optimizer_files(out, key, world, save_id, step)
            aux = _copy_aux(model, source, out)
            _C.write_saved_manifest(out, world, save_id, step, aux,
                                    fsdp1=job.fsdp1 if job is not None else None)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    err = group.broadcast(err)
    if err:
        raise ReshardError(f"reshard.save: writing the manifest of {out} failed on rank 0: {err}")
    return SaveReport(out=out, layout=key, rank=coord, world_size=world, wrote=writes, file=path,
                      optimizer_file=opt_path, bytes=report["bytes"], seconds=report["seconds"],
                      staging_bytes=report["staging_bytes"], save_id=f"{save_id:016x}")


def load_optimizer(optimizer, model: nn.Module, out: str) -> int:
    """Restores the optimizer state that reshard.save wrote into OUT for this job's shard
    coordinate: every state tensor (DTensors sharded like their parameters, 0-dim tensors
    whole; FSDP1: this rank's tensors as saved, which needs the same fsdp1 layout), the
    scalars, and the param_groups' hyper-parameters. `optimizer` must hold the model's
    parameters in the same groups, in the same order, as when saved. Returns the number of
    parameters whose state was restored. Raises ReshardError on any mismatch."""
    from torch.distributed.tensor import DTensor

    from .format import torch_dtype

    job = _fsdp1_job(model, "reshard.load_optimizer")
    if job is not None:
        world, coord, key = job.world, job.coord, job.key
    else:
        world, coord = _shard_coordinate(model)
        key = f"fsdp2-ws{world}"
    odir = os.path.join(out, key, OPTIM_DIR)
    meta_path = os.path.join(odir, OPTIM_JSON)
    path = os.path.join(odir, f"rank-{coord:05d}-of-{world:05d}.reshard")
    if not os.path.exists(os.path.join(out, "reshard.json")):
        raise ReshardError(f"{out}: no reshard.json; not a complete checkpoint")
    for p in (meta_path, path):
        if not os.path.exists(p):
            others = sorted(d for d in os.listdir(out)
                            if d != key and os.path.exists(os.path.join(out, d, OPTIM_DIR, OPTIM_JSON)))
            has = (f"; {out} holds optimizer state for layout(s) {', '.join(others)} only, "
                   f"another layout than this job's {key}" if others else "")
            raise ReshardError(f"{p}: missing; was {out} saved with reshard.save(..., optimizer=...) "
                               f"by a job of this layout ({key}, world size {world})?{has}")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != "reshard.optimizer" or meta.get("format_version") != 1:
        raise ReshardError(f"{meta_path}: not a reshard optimizer description (format version 1)")
    if meta.get("layout", key) != key:
        raise ReshardError(f"{meta_path}: saved for layout {meta['layout']}, this job's is {key}")
    if meta["class"] != type(optimizer).__name__:
        raise ReshardError(f"{meta_path}: saved from a {meta['class']}, this optimizer is a "
                           f"{type(optimizer).__name__}")
    header = json.loads(_C.read_header(path))
    if header["rank"] != coord or header["layout"]["key"] != key:
        raise ReshardError(f"{path}: holds rank {header['rank']} of layout {header['layout']['key']}, "
                           f"this job needs rank {coord} of {key}")
    with open(os.path.join(out, "reshard.json")) as f:
        manifest_source = json.load(f)["source"]
    if header["source"]["fingerprint"] != manifest_source["fingerprint"]:
        raise ReshardError(f"{path}: belongs to another save than {out}/reshard.json "
                           f"({header['source']['fingerprint']} vs {manifest_source['fingerprint']})")
    params = _param_names(model, job is not None)
    names = {id(p): n for n, p in params.items()}
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise ReshardError(f"{meta_path}: {len(meta['param_groups'])} param group(s), the optimizer "
                           f"has {len(optimizer.param_groups)}")
    for gi, (saved, g) in enumerate(zip(meta["param_groups"], optimizer.param_groups)):
        live = [names.get(id(p)) for p in g["params"]]
        if live != saved["params"]:
            raise ReshardError(f"{meta_path}: param_groups[{gi}] holds other parameters than the "
                               "optimizer's (names or order differ)")
    entries = {t["name"]: t for t in header["tensors"]}
    new_state: Dict[torch.Tensor, Dict[str, Any]] = {}
    targets = []
    device_index = None
    group_of = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    if job is not None:  # FSDP1: the state of this shard coordinate
        rank_state = meta.get("rank_state")
        if not isinstance(rank_state, list) or len(rank_state) != world:
            raise ReshardError(f"{meta_path}: no rank_state for the {world} shard coordinates of "
                               f"this FSDP1 job")
        state_desc = rank_state[coord]
    else:
        state_desc = meta["state"]
    for name, desc in state_desc.items():
        if name not in params:
            raise ReshardError(f"{meta_path}: state for {name}, which the model does not have")
        p = params[name]
        local_p = _local(p)
        g = optimizer.param_groups[group_of[id(p)]]
        st: Dict[str, Any] = dict(desc.get("scalars", {}))
        for k, kind in desc["tensors"].items():
            tname = f"{name}{OPTIM_SEP}{k}"
            e = entries.get(tname)
            if e is None:
                raise ReshardError(f"{path}: no tensor {tname!r}")
            if kind == "whole":
                dev = local_p.device if (g.get("capturable") or g.get("fused")) else torch.device("cpu")
                t = torch.empty([], dtype=torch_dtype(e["dtype"]), device=dev)
            elif kind == "local":
                # This rank's own state of its local flat shard / original-parameter view.
                if job is None or e["shard"] is not None or e["local_shape"] != list(local_p.shape):
                    raise ReshardError(
                        f"{path}: {tname} is this rank's local state of shape {e['local_shape']}, "
                        f"but the live parameter {name} has local shape {list(local_p.shape)}"
                        f"{'' if job is not None else ' (and is no FSDP1 parameter)'}: the job's "
                        f"layout or shard coordinate differs from the saved one ({key}, rank {coord})")
                t = torch.empty(e["local_shape"], dtype=torch_dtype(e["dtype"]), device=local_p.device)
            elif kind != "sharded":
                raise ReshardError(f"{meta_path}: state {name}[{k!r}] has kind {kind!r}; expected "
                                   "sharded, whole or local")
            else:
                if e["global_shape"] != list(p.shape) or e["local_shape"] != list(local_p.shape):
                    raise ReshardError(f"{path}: {tname} has shape {e['global_shape']} (local "
                                       f"{e['local_shape']}); the parameter {list(p.shape)} (local "
                                       f"{list(local_p.shape)})")
                t = torch.empty(e["local_shape"], dtype=torch_dtype(e["dtype"]), device=local_p.device)
            if e["nbytes"]:
                on_dev = t.device.type == "cuda"
                if on_dev:
                    device_index = t.device.index
                targets.append((tname, t.data_ptr(), e["nbytes"], on_dev))
            st[k] = t
        new_state[p] = st
    if targets:
        _C.load(path, targets, device=device_index or 0, threads=_default_threads(),
                io="buffered")
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    for p, st in new_state.items():  # sharded state becomes DTensors like its parameter
        if isinstance(p, DTensor):
            for k, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    st[k] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
    for saved, g in zip(meta["param_groups"], optimizer.param_groups):
        for k, v in saved.items():
            if k == "params":
                continue
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    optimizer.state.clear()
    for p, st in new_state.items():
        optimizer.state[p] = st
    return len(new_state)
