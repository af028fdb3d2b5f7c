"""Saving a live (FSDP2 or plain) model, and optionally its optimizer, as a reshard output
directory that ``reshard.load`` and ``reshard verify`` accept: the save half of a training
checkpoint.

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
from .api import _local, _shard_coordinate
from .format import _TORCH_DTYPE_NAMES

OPTIM_DIR = "optim"
OPTIM_JSON = "optimizer.json"
OPTIM_SEP = "#"  # optimizer tensor names: "<parameter name>#<state key>"

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


def _chunk_rows(n: int, world: int, rank: int) -> Tuple[int, int]:
    c = -(-n // world)
    return min(rank * c, n), min((rank + 1) * c, n)


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

    def gather_errors(self, err: Optional[str]) -> List[Optional[str]]:
        if not self.on:
            return [err]
        errs: List[Optional[str]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(errs, err)
        return errs


def _raise_first(errs: List[Optional[str]], what: str) -> None:
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        r, e = bad[0]
        more = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        raise ReshardError(f"{what} failed on rank {r}{more}: {e}")


def _entry(name: str, t: torch.Tensor, global_shape: List[int], world: int, coord: int,
           sharded_like_param: bool) -> Tuple[tuple, torch.Tensor]:
    """One `_C.save` tensor tuple for local tensor `t` (kept alive by the caller)."""
    if t.device.type == "meta":
        raise ReshardError(f"{name} is on the meta device: nothing to save")
    if t.device.type not in ("cpu", "cuda"):
        raise ReshardError(f"{name} is on {t.device}; reshard saves from CUDA or CPU")
    if not t.is_contiguous():
        t = t.contiguous()
    if len(global_shape) == 0:
        sharded, start, end = False, 0, 0
    else:
        start, end = _chunk_rows(global_shape[0], world, coord)
        sharded = True
        if not sharded_like_param:  # a whole tensor on every rank: take this rank's rows
            t = t[start:end]
        if list(t.shape) != [end - start] + list(global_shape[1:]):
            raise ReshardError(
                f"{name}: local shape {list(t.shape)}, but rows [{start}, {end}) of global shape "
                f"{global_shape} by the FSDP2 chunk rule for shard {coord} of {world}: reshard "
                "saves FSDP2 layouts (fully_shard on dim 0)")
    return ((name, _safetensors_dtype(t.dtype), list(global_shape), sharded, start, end,
             t.data_ptr(), t.numel() * t.element_size(), t.device.type == "cuda"), t)


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


def _optimizer_entries(optimizer, model: nn.Module, world: int, coord: int):
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
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


def _write_atomic(path: str, text: str) -> None:
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
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
        for a in names:
            with open(os.path.join(source, a), "rb") as f:
                data = f.read()
            tmp = os.path.join(out, f".{a}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(out, a))
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


def _refuse_fsdp1(model: nn.Module, what: str) -> None:
    from .api import _fsdp1_units

    if _fsdp1_units(model):
        raise ReshardError(
            f"{what}: FSDP1 (FullyShardedDataParallel) models are not supported yet, only FSDP2 "
            "(fully_shard) and plain modules; save an FSDP1 job with torch's own sharded "
            "state_dict, or train with FSDP2")


def save(model: nn.Module, out: str, optimizer=None, step: Optional[int] = None, *,
         source: Optional[str] = None, chunk_size: int = 2 << 20,
         staging_bytes: int = 32 << 20, verify: bool = False) -> SaveReport:
    """Saves `model` (FSDP2 or plain; on CUDA or CPU) as a reshard output directory OUT.

    Collective: every rank of the job calls it. Every shard coordinate's first replica writes
    OUT/fsdp2-wsN/rank-<coord>-of-N.reshard from its local shards; with `optimizer`, also
    OUT/fsdp2-wsN/optim/rank-<coord>-of-N.reshard (state tensors sharded like their
    parameters) and, from rank 0, OUT/fsdp2-wsN/optim/optimizer.json. Rank 0 then copies the
    config and tokenizer files of `source` (the reshard output directory the model was loaded
    from; else it writes the model's config.json) and writes OUT/reshard.json once every file
    is in place. OUT must not already hold a reshard.json. Raises ReshardError on every rank
    when any rank fails; then OUT holds no manifest."""
    out = os.path.abspath(out)
    _refuse_fsdp1(model, "reshard.save")
    world, coord = _shard_coordinate(model)
    writes = _replica_index(model) == 0
    key = f"fsdp2-ws{world}"
    group = _Group()

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
        entries, keep = _model_entries(model, world, coord)
        if optimizer is not None:
            opt_entries, opt_keep, meta = _optimizer_entries(optimizer, model, world, coord)
            meta["step"] = step
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
                          verify=verify, pause_seconds=pause)
            r = _C.save(path, key, world, coord, save_id, step, entries, **kwargs)
            for k in report:  # staging is reused: the peak, not a sum
                report[k] = max(report[k], r[k]) if k == "staging_bytes" else report[k] + r[k]
            if optimizer is not None:
                opt_path = os.path.join(out, key, OPTIM_DIR, name)
                r = _C.save(opt_path, key, world, coord, save_id, step, opt_entries, **kwargs)
                for k in report:
                    report[k] = max(report[k], r[k]) if k == "staging_bytes" else report[k] + r[k]
        if optimizer is not None and group.rank == 0:
            _write_atomic(os.path.join(out, key, OPTIM_DIR, OPTIM_JSON), json.dumps(meta, indent=1))
        del keep
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    _raise_first(group.gather_errors(err), "reshard.save")

    # 3. Every file is committed: rank 0 writes the manifest, the commit point of the save.
    err = None
    if group.rank == 0:
        try:
            if optimizer is not None:
                _check_optimizer_files(out, key, world, save_id, step)
            aux = _copy_aux(model, source, out)
            _C.write_saved_manifest(out, world, save_id, step, aux)
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
    whole), the scalars, and the param_groups' hyper-parameters. `optimizer` must hold the
    model's parameters in the same groups, in the same order, as when saved. Returns the
    number of parameters whose state was restored. Raises ReshardError on any mismatch."""
    from torch.distributed.tensor import DTensor

    from .format import torch_dtype

    _refuse_fsdp1(model, "reshard.load_optimizer")
    world, coord = _shard_coordinate(model)
    key = f"fsdp2-ws{world}"
    odir = os.path.join(out, key, OPTIM_DIR)
    meta_path = os.path.join(odir, OPTIM_JSON)
    path = os.path.join(odir, f"rank-{coord:05d}-of-{world:05d}.reshard")
    if not os.path.exists(os.path.join(out, "reshard.json")):
        raise ReshardError(f"{out}: no reshard.json; not a complete checkpoint")
    for p in (meta_path, path):
        if not os.path.exists(p):
            raise ReshardError(f"{p}: missing; was {out} saved with reshard.save(..., optimizer=...) "
                               f"for world size {world}?")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != "reshard.optimizer" or meta.get("format_version") != 1:
        raise ReshardError(f"{meta_path}: not a reshard optimizer description (format version 1)")
    if meta["class"] != type(optimizer).__name__:
        raise ReshardError(f"{meta_path}: saved from a {meta['class']}, this optimizer is a "
                           f"{type(optimizer).__name__}")
    header = json.loads(_C.read_header(path))
    with open(os.path.join(out, "reshard.json")) as f:
        manifest_source = json.load(f)["source"]
    if header["source"]["fingerprint"] != manifest_source["fingerprint"]:
        raise ReshardError(f"{path}: belongs to another save than {out}/reshard.json "
                           f"({header['source']['fingerprint']} vs {manifest_source['fingerprint']})")
    params = dict(model.named_parameters())
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
    for name, desc in meta["state"].items():
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
        _C.load(path, targets, device=device_index or 0, threads=min(8, os.cpu_count() or 1),
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
