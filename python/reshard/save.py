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

Asynchronous saves (``blocking=False``): the call copies the rank's shards into a snapshot
(engine.snapshot: new GPU memory, or the process's one pinned host buffer) and returns a
SaveHandle; a background thread writes the files and commits, talking to the other ranks over
a gloo group of its own (never the training's group, whose collectives it would race). One
save is in flight per process: the next reshard.save waits for it.

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

DTensor jobs (tensor / expert parallel on a named mesh, possibly fully_shard over one of its
dims): every rank (one mesh coordinate) writes its ``to_local()`` tensors with the placements
the DTensors report, as a rank file of the job's DTensor layout; the layout's plan is made from
those placements (``dtensor_save_layout``, formats/parallel-plan.md *Saved plans*), and
optimizer state shaped like its parameter is stored placed like it.

Expert parallel as torchtitan arranges it (the experts on the job's mesh, the other parameters
fully_shard'ed alone over a 1-D mesh dim outside it: reshard.load_ep.split_dense, the split
reshard.load uses): two layouts in one OUT, the experts (and their state) as the DTensor layout
of their mesh, the rest (and their state, and the persistent buffers, whole) as the FSDP2
layout ``fsdp2-wsN`` of their mesh dim; one rename of the manifest, which rank 0 builds for
both layouts in a private directory, commits both (``_commit_layouts``).

formats/manifest.md (*Saved checkpoints*) and formats/rank-file.md (``source.saved``)
describe what is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from . import _C
from .engine import raw_save_entry, save_entry, save_tensors, snapshot as snapshot_items, write_saved_manifest
from .errors import (InvalidArgumentError, LayoutMismatchError, NotFoundError, ReshardError, UnsupportedError,
                     error_class)
from .layout import chunk_rows, flat_entry_name, is_hf_checkpoint, layout_key, rank_file_name, read_manifest
from .load import local_tensor, shard_coordinate
from .load_dtensor import DTensorJob, dtensor_job, placed_tensors
from .load_fsdp1 import Fsdp1Job, flat_object, fsdp1_job, fsdp1_local_shard
from .model import clean_name, persistent_buffer_names
from .optimizer import OPTIM_DIR, OPTIM_JSON, check_optimizer_files, optimizer_entries

MODEL_MANIFEST = "reshard-model.json"  # formats/model-manifest.md



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
    durable_seconds: float = 0.0  # from the call until the manifest was written (committed)
    stall_seconds: float = 0.0    # how long the call blocked (a blocking save: durable_seconds)
    blocking: bool = True
    snapshot: str = "none"        # asynchronous: where the CUDA shards were copied (device, host)
    snapshot_bytes: int = 0
    # A DTensor job's save: the parallel plan (formats/parallel-plan.md, canonical JSON) that the
    # layout's key names, synthesized from the live placements; written to a file, it lets
    # `reshard convert --mesh ... --plan FILE` make this layout from any checkpoint.
    plan: Optional[str] = None
    # Every rank file this rank wrote (model, then optimizer, per layout): an expert-parallel
    # job's save writes two layouts (`layout` then reads "KEY + KEY").
    files: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Part:
    """One layout a save writes: its key, this rank's rank file (world size, coordinate), what
    goes in it and in its optim/ file, optimizer.json's content, and the layout's fsdp1= /
    dtensor= arguments of _C.save and the manifest."""
    key: str
    world: int
    coord: int
    entries: list
    opt_entries: Optional[list]
    meta: dict
    native: dict


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
    """The collectives save needs, over `pg` (None: the default group); no-ops without a
    process group (one process)."""

    def __init__(self, pg=None):
        dist = torch.distributed
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.on else 0
        self.pg = pg

    def broadcast(self, obj):
        if not self.on:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def all_gather(self, obj) -> List[Any]:
        if not self.on:
            return [obj]
        objs: List[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(objs, obj, group=self.pg)
        return objs


_save_pg = None  # (default group, the gloo group of asynchronous saves' background collectives)


def _background_group() -> "_Group":
    """The group the background half of an asynchronous save talks over: a gloo group of
    every rank (CPU only, so it never queues behind the training's NCCL kernels), made once
    per process group, collectively, the first time an asynchronous save runs."""
    global _save_pg
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _Group()
    default = dist.group.WORLD
    if _save_pg is None or _save_pg[0] is not default:
        _save_pg = (default, dist.new_group(backend="gloo"))
    return _Group(_save_pg[1])


def _error_record(e: BaseException) -> Tuple[str, str]:
    """What one rank sends the others of its error: (code, text). A ReshardError keeps its
    class (by code) when raised again on every rank; another exception becomes a ReshardError
    naming its type."""
    if isinstance(e, ReshardError):
        return (e.code, str(e))
    return ("error", f"{type(e).__name__}: {e}")


def _raise_first(errs: List[Optional[Tuple[str, str]]], what: str) -> None:
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        r, (code, text) = bad[0]
        more = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        raise error_class(code)(f"{what} failed on rank {r}{more}: {text}")


def _model_entries(model: nn.Module, world: int, coord: int, peft_names=None, base: bool = False):
    """Every parameter sharded like the live one and the persistent buffers whole; of a PEFT
    model, the adapter parameters by the names PEFT's save_pretrained gives them, and with
    `base` the base model's parameters and persistent buffers by their original names too."""
    from torch.distributed.tensor import DTensor

    entries, keep = [], []
    for name, p in model.named_parameters():
        if peft_names is not None:
            name = clean_name(name)
            original = peft_names.base_name(name)
            if original is not None and not base:
                continue  # the base model: unchanged by LoRA, loaded from its conversion
            name = original if original is not None else peft_names.saved_key(name)
        is_d = isinstance(p, DTensor)
        e, t = save_entry(name, local_tensor(p).detach(), list(p.shape), world, coord,
                      sharded_like_param=is_d or world == 1)
        entries.append(e)
        keep.append(t)
    if peft_names is not None and not base:
        return entries, keep
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in persistent:  # whole on every rank, as FSDP2 holds them (and convert stores them)
            if peft_names is not None:
                name = peft_names.base_name(clean_name(name))
                if name is None:
                    continue
            e, t = raw_save_entry(name, b.detach(), list(b.shape), False, 0, 0)
            entries.append(e)
            keep.append(t)
    return entries, keep


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
    # Created 0666 less the umask, as open(path, "w") and the rank files beside it are (mkstemp's
    # 0600 kept others sharing the checkpoint from reading its config); a name of its own.
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
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


def _adapter_record(model: nn.Module, entries, base: bool) -> bytes:
    """OUT/reshard-adapter.json of a PEFT model's save (formats/manifest.md): the adapter's
    tensors, whether the base is stored too, and the reshard output the job loaded the base
    from (reshard.load records it), which `reshard export --merge` merges into."""
    loaded = getattr(model, "_reshard_base", None) or {}
    rec = {"format": "reshard.adapter", "format_version": 1,
           "adapter_tensors": sorted(entries),
           "base": {"stored": bool(base), "out": loaded.get("out"), "layout": loaded.get("layout"),
                    "source": loaded.get("source")}}
    return (json.dumps(rec, indent=1) + "\n").encode()


def _aux_files(model: nn.Module, source: Optional[str], peft_names=None,
               record: Optional[bytes] = None) -> List[Tuple[str, bytes]]:
    """(name, content) of the config/tokenizer files the save carries: those listed by the
    source's manifest when SOURCE is a reshard output directory (a checkpoint loaded with
    reshard.load), else config.json (and generation_config.json) written from the model. A
    PEFT model's adapters: PEFT's adapter_config.json first (and the base model's config.json).
    Read when the save is called, so that an asynchronous save writes what was there then."""
    files: List[Tuple[str, bytes]] = []
    if peft_names is not None:
        from .adapters import ADAPTER_CONFIG, adapter_config_json

        from .merge import ADAPTER_RECORD

        files.append((ADAPTER_CONFIG, adapter_config_json(model, peft_names).encode()))
        if record is not None:
            files.append((ADAPTER_RECORD, record))
        if source is None:  # the config and tokenizer files of the base the job loaded
            source = (getattr(model, "_reshard_base", None) or {}).get("out")
        model = peft_names.inner
    manifest = read_manifest(source) if source else None
    names: List[str] = []
    if manifest is not None:
        names = [a for a in manifest.get("aux_files", []) if os.path.exists(os.path.join(source, a))]
        # The model manifest (fsdp1 layouts are planned from it) comes along even when SOURCE
        # lists it not (it holds only fsdp2 layouts): `reshard export` of OUT passes it on, so
        # the export converts into fsdp1 layouts directly.
        if MODEL_MANIFEST not in names and os.path.exists(os.path.join(source, MODEL_MANIFEST)):
            names.append(MODEL_MANIFEST)
        for a in names:
            with open(os.path.join(source, a), "rb") as f:
                files.append((a, f.read()))
    elif source and is_hf_checkpoint(source):  # loaded straight from a Hugging Face checkpoint
        names = [a for a in _C.aux_file_names() if os.path.isfile(os.path.join(source, a))]
        for a in names:
            with open(os.path.join(source, a), "rb") as f:
                files.append((a, f.read()))
    elif source:
        raise NotFoundError(f"source {source}: no reshard.json; pass the reshard output directory "
                           "the model was loaded from (or source=None)")
    if "config.json" not in names and getattr(model, "config", None) is not None:
        files.append(("config.json", model.config.to_json_string().encode()))
        gen = getattr(model, "generation_config", None)
        if gen is not None and "generation_config.json" not in names:
            try:
                files.append(("generation_config.json", gen.to_json_string().encode()))
            except Exception:  # a generation config that cannot be serialized is not essential
                pass
    seen, unique = set(), []
    for name, data in files:
        if name not in seen:
            seen.add(name)
            unique.append((name, data))
    return unique


# ---- DTensor jobs (tensor / expert parallel on a named mesh, FSDP2 over it) -------------------

SAVED_PLAN_NAME = "saved"  # the plan of a DTensor layout written by reshard.save


@dataclasses.dataclass
class DTensorSave:
    """The DTensor layout a save of a DTensor job writes: the job's mesh and the plan that
    gives every parameter its live placements (PlanOfShardings, synthesized by the native
    side from the live placements), and each tensor's (placements, fsdp_mesh_dim)."""
    job: DTensorJob
    key: str
    plan_name: str
    plan_xxh3: int
    plan_json: str
    placed: dict  # clean name -> (placements, fsdp mesh dim or -1), parameters and persistent buffers

    def native(self):
        """The `dtensor` argument of _C.save and _C.write_saved_manifest."""
        return (list(self.job.names), list(self.job.shape), self.plan_name, self.plan_xxh3)


def dtensor_save_layout(model: nn.Module, job: DTensorJob, names: Optional[set] = None,
                        buffers: bool = True) -> DTensorSave:
    """The layout key, plan and per-tensor placements of a save of DTensor job `model`: the
    placements every parameter reports (those fully_shard gave it included), persistent
    buffers whole (R on every mesh dim, as convert stores them). `names`: only these
    parameters (clean names; an expert-parallel job's parameters on the job's mesh), and
    `buffers=False`: no buffers (they go to the FSDP2 layout of the dense parameters). Raises
    UnsupportedError naming the parameter when no parallel plan can say the job's placements."""
    params = {n: p for n, p in ((clean_name(n), p) for n, p in model.named_parameters())
              if names is None or n in names}
    persistent = persistent_buffer_names(model) if buffers else set()
    kept = [(n, b.dim()) for n, b in ((clean_name(n), b) for n, b in model.named_buffers()) if n in persistent]
    tensors, placed = placed_tensors(job, params, kept)
    try:
        key, plan_name, xxh3, plan_json = _C.plan_of_placements(SAVED_PLAN_NAME, list(job.names),
                                                               list(job.shape), tensors)
    except UnsupportedError as e:
        raise UnsupportedError(f"reshard.save cannot record this job's layout: {e}") from e
    return DTensorSave(job, key, plan_name, xxh3, plan_json, placed)


def _dtensor_model_entries(model: nn.Module, dt: DTensorSave):
    """Every parameter's local tensor (to_local(), contiguous) with its placements, then the
    persistent buffers whole: the entries `reshard convert --mesh ... --plan ...` writes."""
    entries, keep = [], []
    for name, p in model.named_parameters():
        name = clean_name(name)
        if name not in dt.placed:  # an expert-parallel job's dense parameter: in its FSDP2 layout
            continue
        e, t = raw_save_entry(name, local_tensor(p).detach(), list(p.shape), False, 0, 0)
        e.placements, e.fsdp_mesh_dim = dt.placed[name]
        entries.append(e)
        keep.append(t)
    persistent = persistent_buffer_names(model)
    seen = {e.name for e in entries}
    for name, b in model.named_buffers():
        name = clean_name(name)
        if name in persistent and name not in seen and name in dt.placed:
            seen.add(name)
            e, t = raw_save_entry(name, b.detach(), list(b.shape), False, 0, 0)
            e.placements, e.fsdp_mesh_dim = dt.placed[name]
            entries.append(e)
            keep.append(t)
    return entries, keep


@dataclasses.dataclass
class DenseSave:
    """An expert-parallel job's parameters fully_shard'ed over a 1-D mesh dim outside the
    experts' mesh (torchtitan's dense mesh, reshard.load_ep.split_dense): saved as the FSDP2
    layout fsdp2-wsN of that dim, with the persistent buffers (whole, as FSDP2 saves store them)."""
    names: List[str]    # clean names
    mesh_dim: str
    world: int
    coord: int
    key: str


def ep_dense_save(model: nn.Module, job: DTensorJob) -> Optional[DenseSave]:
    """The FSDP2 part of a save of `job` when it is expert parallel as torchtitan arranges it
    (some parameters fully_shard'ed over a mesh dim outside the job's mesh), else None. The
    split is reshard.load_ep.split_dense's: what loads as an FSDP2 job is saved as one."""
    from .load_ep import dense_shard, split_dense

    params = {clean_name(n): p for n, p in model.named_parameters()}
    _, dense = split_dense(job, params)
    if not dense:
        return None
    mesh_dim, ws, coord = dense_shard(job, dense)
    return DenseSave(list(dense), mesh_dim, ws, coord, layout_key(ws))


def _dense_model_entries(model: nn.Module, ds: DenseSave):
    """The dense parameters sharded as FSDP2 holds them (the FSDP2 chunk rule over ds.world),
    then every persistent buffer whole: the entries of an FSDP2 save."""
    want = set(ds.names)
    entries, keep = [], []
    for name, p in model.named_parameters():
        name = clean_name(name)
        if name not in want:
            continue
        e, t = save_entry(name, local_tensor(p).detach(), list(p.shape), ds.world, ds.coord, sharded_like_param=True)
        entries.append(e)
        keep.append(t)
    persistent = persistent_buffer_names(model)
    seen = set()
    for name, b in model.named_buffers():
        name = clean_name(name)
        if name in persistent and name not in seen:
            seen.add(name)
            e, t = raw_save_entry(name, b.detach(), list(b.shape), False, 0, 0)
            entries.append(e)
            keep.append(t)
    return entries, keep


# ---- FSDP1 (FullyShardedDataParallel, FlatParameter) -----------------------------------------

def _fsdp1_model_entries(model: nn.Module, job: Fsdp1Job):
    """One flat entry per unit (the local shard, padding included), in construction order, then
    the persistent buffers whole: the entries `reshard convert --layout fsdp1` writes."""

    entries, keep = [], []
    for u, _, h in job.units:
        name = flat_entry_name(u)
        t = fsdp1_local_shard(u, h, job.world)
        flat = flat_object(u, h)
        start, end = chunk_rows(flat.numel, job.world, job.coord)
        e, t = raw_save_entry(name, t, [flat.numel], True, start, end, flat)
        entries.append(e)
        keep.append(t)
    persistent = persistent_buffer_names(model)
    # FSDP1 MixedPrecision(buffer_dtype=...) casts buffers in place; like FSDP's own
    # state_dict, save them in the dtype they had (the root FSDP state records it).
    orig_dtypes = getattr(model, "_buffer_name_to_orig_dtype", None) or {}
    seen = set()
    for n, b in model.named_buffers():
        n = clean_name(n)
        if n in persistent and n not in seen:
            seen.add(n)
            t = b.detach()
            want = orig_dtypes.get(n)
            if want is not None and t.is_floating_point() and t.dtype != want:
                t = t.to(want)
            e, t = raw_save_entry(n, t, list(b.shape), False, 0, 0)
            entries.append(e)
            keep.append(t)
    return entries, keep


def _fsdp1_start(model: nn.Module, group: "_Group") -> Tuple[Optional[Fsdp1Job], bool]:
    """Collective for FSDP1 models: (the job's FSDP1 layout, whether this process writes its
    shard coordinate's files). The first process (lowest global rank) of each coordinate
    writes (HYBRID_SHARD: one replica); every coordinate 0..W-1 must be held by a process. A
    refusal on any rank is raised on every rank. (None, False) for other models."""
    try:
        job, err = fsdp1_job(model, "reshard.save"), None
    except ReshardError as e:
        job, err = None, _error_record(e)
    if job is None and err is None:
        return None, False
    gathered = group.all_gather((err, job.world if job else None, job.coord if job else None))
    _raise_first([g[0] for g in gathered], "reshard.save")
    coords = [(w, c) for _, w, c in gathered]
    worlds = {w for w, _ in coords}
    if len(worlds) != 1:
        raise LayoutMismatchError(f"reshard.save: processes disagree on the shard group size ({sorted(worlds)})")
    held = {c for _, c in coords}
    if held != set(range(job.world)):
        raise LayoutMismatchError(f"reshard.save: shard coordinates {sorted(set(range(job.world)) - held)} "
                           f"of {job.world} are held by no process")
    return job, min(r for r, (_, c) in enumerate(coords) if c == job.coord) == group.rank


class SaveHandle:
    """An asynchronous reshard.save in flight (`blocking=False`): the rank's shards were
    copied into a snapshot when the call returned; a background thread writes, checksums and
    fsyncs the rank files, and rank 0 commits the manifest once every rank's files are
    durable. `wait()` returns the SaveReport or raises what the save met (on every rank);
    an error nobody waited for is raised by the next reshard.save of the process."""

    def __init__(self, out: str, stall_seconds: float, snapshot: str, snapshot_bytes: int):
        import threading

        self.out = out
        self.stall_seconds = stall_seconds     # how long the call blocked training
        self.snapshot = snapshot               # where the CUDA shards were copied: device, host, none
        self.snapshot_bytes = snapshot_bytes
        self._done = threading.Event()
        self._report: Optional[SaveReport] = None
        self._error: Optional[BaseException] = None
        self._reported = False
        self._thread: Optional["threading.Thread"] = None

    def done(self) -> bool:
        """True once the save has committed or failed (wait() then returns at once)."""
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> SaveReport:
        """Waits for the save to be committed (durable, manifest written) and returns its
        report; raises the ReshardError it met, or TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"reshard.save of {self.out} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._report is not None
        return self._report

    def _run(self, work) -> None:
        try:
            self._report = work()
        except BaseException as e:  # noqa: BLE001 - handed to wait() / the next save
            self._error = e
        finally:
            self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else ("committed" if self.done() else "writing")
        return f"SaveHandle({self.out!r}, {state}, stall {self.stall_seconds:.3f} s, snapshot {self.snapshot})"


_pending: Optional[SaveHandle] = None  # this process's asynchronous save in flight, if any


def _take_pending(wrap: bool) -> Optional[SaveReport]:
    """Waits for this process's asynchronous save in flight, if any (it is no longer pending
    after), and returns its report; raises its error unless its handle's wait() already did
    (`wrap`: as an error of the save that found it, naming the failed one)."""
    global _pending
    h, _pending = _pending, None
    if h is None:
        return None
    already = h._reported
    try:
        return h.wait()
    except BaseException as e:
        if already:
            return None
        if wrap:
            raise error_class(getattr(e, "code", "error"))(
                f"the previous asynchronous reshard.save ({h.out}) failed, and nothing waited for it: {e}") from e
        raise


def wait_pending() -> Optional[SaveReport]:
    """Waits for this process's asynchronous save in flight, if any, and returns its report
    (None when there is none); raises its error unless its handle's wait() already did."""
    return _take_pending(wrap=False)


def _finish_previous() -> None:
    """reshard.save starts by waiting for the previous asynchronous save of the process: one
    is in flight at a time, and a failure nobody waited for is raised here."""
    _take_pending(wrap=True)


_atexit_registered = False


def _atexit_pending() -> None:
    h = _pending
    if h is None or h._reported:
        return
    import sys

    try:
        h.wait()
    except BaseException as e:  # noqa: BLE001
        print(f"reshard.save: the asynchronous save of {h.out} failed: {e}", file=sys.stderr, flush=True)


def save(model: nn.Module, out: str, optimizer=None, step: Optional[int] = None, *,
         source: Optional[str] = None, chunk_size: int = _C.DEFAULT_CHUNK_SIZE,
         staging_bytes: int = 32 << 20, verify: bool = False, blocking: bool = True,
         snapshot: str = "auto", base: bool = False):
    """Saves `model` (FSDP2, FSDP1 or plain; on CUDA or CPU) as a reshard output directory OUT.

    Collective: every rank of the job calls it. Every shard coordinate's first replica writes
    OUT/KEY/rank-<coord>-of-N.reshard from its local shards, KEY being fsdp2-wsN (FSDP2 and
    plain modules), the job's fsdp1 layout key (FullyShardedDataParallel, e.g.
    fsdp1-wsN-LlamaDecoderLayer-orig-pbf16) or, for a DTensor job (every mesh coordinate
    writes), its DTensor key dtensor-<mesh>-saved.<h> (report.plan: the plan; an expert-parallel
    job in torchtitan's arrangement writes both that key, for the experts, and fsdp2-wsN, for the
    parameters fully_shard'ed over the dense mesh and the buffers: report.layout "KEY + KEY",
    report.files every file written); with `optimizer`, also
    OUT/KEY/optim/rank-<coord>-of-N.reshard (FSDP2: state tensors sharded like their
    parameters; FSDP1: this rank's state tensors as they are) and, from rank 0,
    OUT/KEY/optim/optimizer.json. Rank 0 then copies the config and tokenizer files (and
    reshard-model.json) of `source` (the reshard output directory the model was loaded from;
    else it writes the model's config.json) and writes OUT/reshard.json once every file is in
    place. OUT must not already hold a reshard.json. Raises ReshardError on every rank when
    any rank fails; then OUT holds no manifest. Returns a SaveReport.

    `blocking=False`: returns a SaveHandle as soon as the rank's shards (and optimizer state)
    are copied into a snapshot — `snapshot="device"`: new GPU memory (a device-to-device
    copy); "host": one reused host buffer of the process, pinned; "auto" (default): device
    when the job's peak GPU allocation so far plus the snapshot fits in 90 % of the GPU, else
    host — and writes in a background thread while training goes on; the commit is the same
    (manifest last, by rank 0, once every rank's files are durable). One save is in flight at
    a time: the next reshard.save waits for the previous one (and raises its error if nothing
    waited for it). Call handle.wait() (or reshard.wait_pending()) before destroying the
    process group.

    A PEFT (LoRA) model: its adapters, by PEFT's saved names, and OUT/adapter_config.json;
    with `base=True` the base model's parameters and persistent buffers too, by their original
    names (as its conversion has them), so that OUT alone restores the model
    (`reshard.load(peft_model, OUT)`) and exports it (`reshard export OUT`: the base,
    `--adapter`: the adapters, `--merge`: merged). OUT/reshard-adapter.json records which."""
    import time

    t_call = time.perf_counter()
    _finish_previous()
    out = os.fspath(out)  # a pathlib.Path too
    out = os.path.abspath(out)
    group = _Group()
    from .adapters import is_peft_model, save_names

    peft_names = save_names(model) if is_peft_model(model) else None
    if base and peft_names is None:
        raise InvalidArgumentError("reshard.save(..., base=True) applies to a PEFT model (its base "
                                   "weights beside the adapters); a model's weights are always saved")
    job, writes = _fsdp1_start(model, group)
    if job is not None and peft_names is not None:
        raise UnsupportedError("reshard.save of a PEFT model under FSDP1: PEFT models are saved "
                               "under FSDP2 (fully_shard) or unsharded")
    dt: Optional[DTensorSave] = None
    dense: Optional[DenseSave] = None  # expert parallel (torchtitan): the dense parameters' FSDP2 layout
    dt_err = None
    dt_job = dtensor_job(model) if job is None else None
    from .model import require_fsdp2_sharded

    require_fsdp2_sharded(model, "reshard.save")  # gathered parameters are not this rank's shards
    if job is not None:
        world, coord, key = job.world, job.coord, job.key
    elif dt_job is not None:  # tensor / expert parallel: every mesh coordinate writes its file
        if peft_names is not None:
            raise UnsupportedError("reshard.save of a PEFT model on a DTensor mesh of several dims: PEFT "
                                   "models are saved under FSDP2 (fully_shard) or unsharded")
        world, coord, writes = dt_job.world_size, dt_job.rank, True
        try:  # the same placements on every rank: the same outcome; rank 0 broadcasts its own
            procs = torch.distributed.get_world_size() if group.on else 1
            if procs != dt_job.world_size:
                # Ranks outside the mesh (pipeline stages, replicas on top) would write the same
                # rank files with other tensors, the last rename winning.
                raise UnsupportedError(
                    f"the parameters' device mesh {dt_job.mesh_flag()} has {dt_job.world_size} ranks, the job "
                    f"{procs} processes: reshard.save writes one rank file per mesh coordinate, so the mesh must "
                    "cover every process (name every parallel dim in it, e.g. init_device_mesh with dp_replicate "
                    "or pp dims)")
            dense = ep_dense_save(model, dt_job)
            on_mesh = None
            if dense is not None:  # the experts (on the job's mesh) alone; the buffers go with the dense part
                on_mesh = {clean_name(n) for n, _ in model.named_parameters()} - set(dense.names)
            dt = dtensor_save_layout(model, dt_job, names=on_mesh, buffers=dense is None)
            key = dt.key
        except ReshardError as e:
            dt_err, key = _error_record(e), None
    else:
        world, coord = shard_coordinate(model)
        writes = _replica_index(model) == 0
        key = layout_key(world)

    # 1. Rank 0 checks OUT, creates its directories and picks the save's id.
    msg: Any = None
    if group.rank == 0:
        try:
            if dt_err is not None:
                raise error_class(dt_err[0])(f"reshard.save of {out}: {dt_err[1]}")
            if os.path.exists(os.path.join(out, "reshard.json")):
                raise InvalidArgumentError(f"{out} already holds a checkpoint (reshard.json); save into a "
                                   "new directory")
            import shutil

            for stale in os.listdir(out) if os.path.isdir(out) else []:  # of a save killed before its commit
                if stale.startswith(COMMIT_DIR):
                    shutil.rmtree(os.path.join(out, stale), ignore_errors=True)
            for k in [key] + ([dense.key] if dense is not None else []):
                os.makedirs(os.path.join(out, k, OPTIM_DIR) if optimizer is not None
                            else os.path.join(out, k), exist_ok=True)
            msg = ("ok", int.from_bytes(os.urandom(8), "little"))
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            msg = ("error", _error_record(e))
    msg = group.broadcast(msg)
    if msg[0] == "error":
        raise error_class(msg[1][0])(msg[1][1])
    save_id = msg[1]

    # 2. What each writing rank writes (the tensors as they are now), and rank 0's aux files.
    err = None
    entries: list = []
    opt_entries: list = []
    meta: dict = {}
    d_entries: list = []       # an expert-parallel job's dense part (FSDP2 layout)
    d_opt_entries: list = []
    d_meta: dict = {}
    nd = nod = None  # where the dense part's items start in entries / opt_entries
    aux: List[Tuple[str, bytes]] = []
    device = 0
    where, snap_bytes = "none", 0
    try:
        if dt_err is not None:
            raise error_class(dt_err[0])(dt_err[1])
        if job is not None:
            entries, _ = _fsdp1_model_entries(model, job)  # the items hold their tensors
        elif dt is not None:
            entries, _ = _dtensor_model_entries(model, dt)
            if dense is not None:
                d_entries, _ = _dense_model_entries(model, dense)
        else:
            entries, _ = _model_entries(model, world, coord, peft_names, base)
        if optimizer is not None:
            opt_entries, _, meta = optimizer_entries(optimizer, model, world, coord,
                                                     fsdp1=job is not None,
                                                     dtensor=dt.placed if dt is not None else None,
                                                     only=set(dt.placed) if dense is not None else None)
            meta["step"] = step
            meta["layout"] = key
            if dense is not None:  # the dense parameters' state, sharded like them (FSDP2)
                d_opt_entries, _, d_meta = optimizer_entries(optimizer, model, dense.world, dense.coord,
                                                             only=set(dense.names))
                d_meta["step"] = step
                d_meta["layout"] = dense.key
                meta["parts"] = d_meta["parts"] = [key, dense.key]
        nd, nod = len(entries), len(opt_entries)  # one list for the checks and the snapshot; split below
        entries += d_entries
        opt_entries += d_opt_entries
        devices = {it.tensor.device.index for it in entries + opt_entries if it.tensor.device.type == "cuda"}
        if len(devices) > 1:
            raise InvalidArgumentError("tensors on several CUDA devices; reshard.save expects one device per rank")
        device = devices.pop() if devices else 0
        if not writes:  # an HSDP replica other than the first: checked, writes nothing
            entries, opt_entries, nd, nod = [], [], 0, 0
        if any(it.tensor.device.type == "cuda" for it in entries + opt_entries):
            torch.cuda.synchronize(device)  # the copier's stream must see finished updates
        if not blocking:
            where, snap_bytes = snapshot_items(entries + opt_entries, snapshot)
        if group.rank == 0:
            record = None
            if peft_names is not None:
                names = [clean_name(n) for n, _ in model.named_parameters()]
                record = _adapter_record(model, [peft_names.saved_key(n) for n in names
                                                 if peft_names.base_name(n) is None], base)
            aux = _aux_files(model, source, peft_names, record)
    except Exception as e:  # noqa: BLE001
        err = _error_record(e)

    # The layouts written: the job's own; for an expert-parallel job also the dense FSDP2 one.
    if nd is None:  # failed before (err is set: nothing is written)
        nd, nod = len(entries), len(opt_entries)
    parts = [_Part(key, world, coord, entries[:nd], opt_entries[:nod] if optimizer is not None else None, meta,
                   dict(fsdp1=job.fsdp1 if job is not None else None,
                        dtensor=dt.native() if dt is not None else None))]
    if dense is not None:
        parts.append(_Part(dense.key, dense.world, dense.coord, entries[nd:],
                           opt_entries[nod:] if optimizer is not None else None, d_meta,
                           dict(fsdp1=None, dtensor=None)))
    entries, opt_entries = [], []  # held by the parts

    def write_and_commit(group: _Group, err=None) -> SaveReport:
        report = _write_and_commit(group, out, parts, writes, save_id, step, job, aux, device,
                                   dict(chunk_size=chunk_size, device=device, staging_bytes=staging_bytes,
                                        verify=verify),
                                   t_call, err=err)
        if dt is not None:
            report.plan = dt.plan_json
        return report

    if blocking:  # an error here: every rank learns of it in the outcome gather, nothing written
        report = write_and_commit(group, err)
        report.stall_seconds = report.durable_seconds
        return report

    # 3 (asynchronous). Every rank's snapshot is taken (or some rank had no room for one:
    # then every rank writes now, as a blocking save, and returns a handle already done).
    gathered = group.all_gather((err, where))
    _raise_first([e for e, _ in gathered], "reshard.save")
    if any(w == "blocking" for _, w in gathered):
        import warnings

        short = [r for r, (_, w) in enumerate(gathered) if w == "blocking"]
        warnings.warn(f"reshard.save(blocking=False): rank(s) {short} have no room for a snapshot in GPU or "
                      "host memory; the save is written before the call returns, through the bounded "
                      "staging of a blocking save", stacklevel=2)
        report = write_and_commit(group)
        report.stall_seconds = report.durable_seconds
        handle = SaveHandle(out, report.stall_seconds, "none", 0)
        handle._report = report
        handle._done.set()
        return handle
    bg = _background_group()
    handle = SaveHandle(out, time.perf_counter() - t_call, where, snap_bytes)

    def work() -> SaveReport:
        report = write_and_commit(bg)
        report.blocking = False
        report.stall_seconds = handle.stall_seconds
        report.snapshot, report.snapshot_bytes = where, snap_bytes
        return report

    import threading

    global _atexit_registered
    if not _atexit_registered:
        import atexit

        atexit.register(_atexit_pending)
        _atexit_registered = True
    handle._thread = threading.Thread(target=handle._run, args=(work,), name=f"reshard.save {out}",
                                      daemon=False)
    global _pending
    handle._thread.start()
    _pending = handle
    return handle


def _write_and_commit(group: _Group, out, parts: List[_Part], writes, save_id, step, job, aux, device,
                      kwargs, t_call, err=None) -> SaveReport:
    """Every writing rank writes its files (each part's rank file and optim/ file); once every
    rank has, rank 0 writes the optimizer descriptions, the aux files and the manifest listing
    every part's layout at once (the commit point). Collective over `group`."""
    import time

    paths, opt_paths = [], []
    report = {"bytes": 0, "seconds": 0.0, "staging_bytes": 0}
    if err is None:
        try:
            if writes:
                for part in parts:
                    name = rank_file_name(part.coord, part.world)
                    path = os.path.join(out, part.key, name)
                    files = [(path, part.entries)]
                    paths.append(path)
                    if part.opt_entries is not None:
                        opt_path = os.path.join(out, part.key, OPTIM_DIR, name)
                        files.append((opt_path, part.opt_entries))
                        opt_paths.append(opt_path)
                    for p, items in files:
                        r = save_tensors(p, part.key, part.world, part.coord, save_id, step, items, **kwargs,
                                         **part.native)
                        for k in report:  # staging is reused: the peak, not a sum
                            v = getattr(r, k)
                            report[k] = max(report[k], v) if k == "staging_bytes" else report[k] + v
        except Exception as e:  # noqa: BLE001
            err = _error_record(e)
    with_optimizer = parts[0].opt_entries is not None
    for part in parts:  # the snapshot (or the live tensors) is no longer needed
        part.entries.clear()
        if part.opt_entries is not None:
            part.opt_entries.clear()
    # FSDP1 optimizer state differs between shard coordinates (use_orig_params: which views
    # have elements, hence state, on this rank): each writer sends its description to rank 0.
    mine = None
    if err is None and with_optimizer and job is not None and writes:
        mine = (parts[0].coord, parts[0].meta["state"])
    outcomes = group.all_gather((err, mine))
    _raise_first([e for e, _ in outcomes], "reshard.save")

    # Every file is committed: rank 0 writes the manifest, the commit point of the save.
    err = None
    if group.rank == 0:
        try:
            if with_optimizer:
                for part in parts:
                    meta = part.meta
                    if job is not None:
                        by_coord = {c: st for _, m in outcomes if m is not None for c, st in [m]}
                        meta = dict(meta)
                        del meta["state"]
                        meta["rank_state"] = [by_coord[c] for c in range(part.world)]
                    _write_atomic(os.path.join(out, part.key, OPTIM_DIR, OPTIM_JSON), json.dumps(meta, indent=1))
                    check_optimizer_files(out, part.key, part.world, save_id, step)
            for name, data in aux:
                _write_atomic(os.path.join(out, name), data)
            if len(parts) == 1:
                write_saved_manifest(out, parts[0].world, save_id, step, [n for n, _ in aux], **parts[0].native)
            else:
                _commit_layouts(out, parts, save_id, step, [n for n, _ in aux])
        except Exception as e:  # noqa: BLE001
            err = _error_record(e)
    err = group.broadcast(err)
    if err:
        raise error_class(err[0])(f"reshard.save: writing the manifest of {out} failed on rank 0: {err[1]}")
    return SaveReport(out=out, layout=" + ".join(p.key for p in parts), rank=parts[0].coord,
                      world_size=parts[0].world, wrote=writes, file=paths[0] if paths else None,
                      optimizer_file=opt_paths[0] if opt_paths else None, bytes=report["bytes"],
                      seconds=report["seconds"], staging_bytes=report["staging_bytes"],
                      save_id=f"{save_id:016x}", durable_seconds=time.perf_counter() - t_call,
                      files=paths + opt_paths)


COMMIT_DIR = ".reshard-commit-"  # + hex16 of the save id: where a save of two layouts builds its manifest


def _commit_layouts(out: str, parts: List[_Part], save_id: int, step, aux: List[str]) -> None:
    """Commits the layouts of one save together: one rename of OUT/reshard.json that lists all
    of them, or no manifest at all. The native writer (which reads back and checks every rank
    file of a layout, and adds its entry to a manifest of the same save) builds the manifest in
    a private directory OUT/.reshard-commit-<id>/ whose entries link to OUT's layout
    directories, one layout after the other; the result, naming each layout's directory
    relative to OUT, is then written to OUT/reshard.json atomically, and the directory removed.
    A save killed before that rename leaves no reshard.json (load and verify refuse OUT); a
    leftover commit directory is removed by the next save into OUT."""
    import shutil

    stage = os.path.join(out, f"{COMMIT_DIR}{save_id:016x}")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    try:
        for part in parts:
            os.symlink(os.path.join("..", part.key), os.path.join(stage, part.key))
        keys = [p.key for p in parts]
        for part in parts:
            write_saved_manifest(stage, part.world, save_id, step, aux, parts=keys, **part.native)
        with open(os.path.join(stage, "reshard.json"), "rb") as f:
            manifest = f.read()
        listed = json.loads(manifest).get("layouts", {})
        if sorted(listed) != sorted(keys) or not all(v.get("complete") and v.get("parts") == sorted(keys)
                                                       for v in listed.values()):
            raise LayoutMismatchError(f"{stage}/reshard.json lists layouts {sorted(listed)}, expected every one "
                                      f"of {[p.key for p in parts]} complete")
        _write_atomic(os.path.join(out, "reshard.json"), manifest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
