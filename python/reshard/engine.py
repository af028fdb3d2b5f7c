"""The copy engine, as the torch-aware package drives it: this process's reader threads and
CUDA copier (set up once, `prepare`), and the calls that move bytes between rank files and
tensors through the extension (`load_tensors`, `save_tensors`). Everything that turns
tensors into raw (pointer, size) targets is here, so the rest of the package never touches
the binding's calling conventions."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Sequence, Tuple

import torch

from . import _C
from .errors import InvalidArgumentError, UnsupportedError
from .layout import chunk_rows, safetensors_dtype, torch_dtype

# Host memory used at once by dtype-converting loads (file dtype != live dtype).
CONVERT_BATCH_BYTES = 64 << 20

_chosen_threads: Optional[int] = None  # set by prepare(threads=...): the process's default
_atexit_registered = False


def default_threads() -> int:
    """Reader threads of a load (and lanes of its CUDA copier) when the caller names none:
    what reshard.prepare(threads=...) chose for this process, else 16 (the best measured on
    the GPU machine, BENCHMARKS.md) or this process's share of the CPUs it may run on among
    the job's processes on this host (torchrun's LOCAL_WORLD_SIZE), at least 4. One number
    per process keeps it to one copy engine (streams and pinned staging)."""
    if _chosen_threads:
        return _chosen_threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(4, min(16, cpus // local))


def prepare(device=None, threads: Optional[int] = None, *, wait: bool = False) -> bool:
    """Starts making the CUDA copy engine of this process (streams and pinned staging) on a
    background thread, so that the first reshard.load finds it ready instead of paying its
    one-time set-up (5-11 ms measured on the GPU machine, BENCHMARKS.md). Call it early, e.g.
    right after choosing the rank's GPU and before building the model; reshard.empty_model
    and reshard.fsdp1_param_init_fn call it for you when CUDA is initialised. `threads`
    becomes this process's default for reshard.load and reshard.load_optimizer (so they use
    the copy engine prepared here). A load that comes before the set-up has finished waits
    for it. Returns False (and does nothing) without CUDA or with RESHARD_PREPARE=0; with
    `wait`, returns once the set-up is done (raising what it met)."""
    global _atexit_registered, _chosen_threads
    if os.environ.get("RESHARD_PREPARE", "1") == "0" or not torch.cuda.is_available():
        return False
    if not _C.build_info()["cuda"]:
        return False
    if device is None:
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _atexit_registered:  # no set-up thread may still run while the process exits
        import atexit

        atexit.register(_wait_prepared_at_exit)
        _atexit_registered = True
    if threads:
        _chosen_threads = int(threads)
    _C.prepare(index, default_threads(), wait=wait)
    return True


def _wait_prepared_at_exit() -> None:
    try:
        _C.wait_prepared()
    except Exception:  # noqa: BLE001 - a set-up nobody used failed: nothing to report now
        pass


def prepare_quietly(device=None) -> None:
    """prepare() where CUDA is already initialised (never creates a context on its own) and
    the device is this process's own: the given one, or the current device when it is the
    one torchrun's LOCAL_RANK points at (a process that touched CUDA before set_device would
    otherwise set up GPU 0 for every rank)."""
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        if device is None:
            local = os.environ.get("LOCAL_RANK")
            if local is not None and torch.cuda.current_device() != int(local) % torch.cuda.device_count():
                return
        prepare(device)
    except Exception:  # noqa: BLE001 - an optimisation only: the load does the set-up itself
        pass


# ---- loading ----------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadReport:
    file: str
    layout: str
    rank: int
    world_size: int
    bytes: int
    seconds: float
    gbps: float
    tensors: int
    staging_bytes: int
    direct_io: bool
    threads: int
    converted_tensors: int
    buffers_restored: List[str]
    staging_alloc_seconds: float = 0.0  # of `seconds`: pinned staging made by this load (0: reused/prepared)
    pooled: bool = False  # the reader threads were the copy engine's own (started once, by prepare)
    untied: List[str] = dataclasses.field(default_factory=list)  # "copy = source": tied in the model, split by the sharding, loaded from one entry
    adapters: dict = dataclasses.field(default_factory=dict)  # PEFT: {"source": adapter dir or how initialised, "tensors": n}

    def __str__(self) -> str:  # what a person reads; repr() keeps every field
        return (f"rank {self.rank}/{self.world_size}: loaded {_C.format_bytes(self.bytes)} of {self.layout} "
                f"from {self.file} in {self.seconds:.3f} s ({_C.format_rate(self.gbps * 1e9)}), "
                f"{self.tensors} tensor(s)")


def target_device(t: torch.Tensor, what: str, device_index: Optional[int]) -> Tuple[bool, Optional[int]]:
    """(on CUDA?, the rank's CUDA device index so far): one CUDA device per rank, or CPU."""
    if t.device.type == "cuda":
        if device_index is not None and device_index != t.device.index:
            raise InvalidArgumentError(f"{what}: tensors on several CUDA devices; reshard.load "
                                       "expects one device per rank")
        return True, t.device.index
    if t.device.type != "cpu":
        raise UnsupportedError(f"{what} is on {t.device}; reshard loads onto CUDA or CPU")
    return False, device_index


def open_rank_file(path: str) -> "_C.RankFile":
    """The rank file at `path`, opened and checked once (preamble, header, invariants); its
    `tensors` describe every entry and `load` moves them."""
    return _C.RankFile.open(str(path))


def target(name: str, t: torch.Tensor, nbytes: int, on_device: bool) -> "_C.LoadTarget":
    """The destination of a load: `nbytes` at `t`'s data (contiguous, alive until the load
    returns)."""
    return _C.LoadTarget(name, t.data_ptr(), nbytes, on_device)


def load_tensors(rank_file: "_C.RankFile", targets: Sequence["_C.LoadTarget"], *, device: int = 0,
                 threads: Optional[int] = None, verify: bool = True, io: str = "auto") -> "_C.LoadStats":
    """Moves rank-file tensors into their targets (on_device ones through this process's CUDA
    copy engine for `device`)."""
    return rank_file.load(list(targets), device=device, threads=threads or default_threads(),
                          verify=verify, io=io)


def load_via_host(rank_file, entries: dict, items, device: int, threads: int, verify: bool):
    """Loads entries into host tensors of the file's dtype, batch by batch, and copies them
    into their destinations (converting exactly as Tensor.to() when the dtypes differ).
    Returns (bytes, seconds)."""
    total_bytes, total_seconds = 0, 0.0
    batch, size = [], 0
    for item in list(items) + [None]:
        if item is not None:
            k, dst = item
            e = entries[k]
            batch.append((k, dst, torch.empty(e.local_shape, dtype=torch_dtype(e.dtype))))
            size += e.nbytes
        if batch and (item is None or size >= CONVERT_BATCH_BYTES):
            r = load_tensors(rank_file, [target(k, t, t.numel() * t.element_size(), False)
                                         for k, _, t in batch], device=device, threads=threads,
                             verify=verify, io="buffered")
            total_bytes += r.bytes
            total_seconds += r.seconds
            with torch.no_grad():
                for _, dst, t in batch:
                    dst.copy_(t)  # same rounding as Tensor.to()
            batch, size = [], 0
    return total_bytes, total_seconds


# ---- saving -----------------------------------------------------------------------------------

def raw_save_entry(name: str, t: torch.Tensor, global_shape: List[int], sharded: bool, start: int,
                   end: int, flat: Optional["_C.FlatInfo"] = None) -> Tuple["_C.SaveTensor", torch.Tensor]:
    """A save tensor for `t` stored as it is (the caller has checked its shape; `flat`: an
    FSDP1 flat shard of that unit), and the tensor to keep alive until the save returns."""
    if t.device.type == "meta":
        raise InvalidArgumentError(f"{name} is on the meta device: nothing to save")
    if t.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"{name} is on {t.device}; reshard saves from CUDA or CPU")
    if not t.is_contiguous():
        t = t.contiguous()
    dtype = safetensors_dtype(t.dtype)
    if dtype is None:
        raise UnsupportedError(f"{name}: dtype {t.dtype} has no safetensors name; reshard cannot save it")
    return (_C.SaveTensor(name, dtype, [int(d) for d in global_shape], (start, end) if sharded else None,
                          t.data_ptr(), t.numel() * t.element_size(), t.device.type == "cuda", flat), t)


def save_entry(name: str, t: torch.Tensor, global_shape: List[int], world: int, coord: int,
               sharded_like_param: bool) -> Tuple[tuple, torch.Tensor]:
    """A save tensor for local tensor `t`, sharded by the FSDP2 rule (0-dim: whole)."""
    from .errors import LayoutMismatchError

    if len(global_shape) == 0:
        return raw_save_entry(name, t, global_shape, False, 0, 0)
    start, end = chunk_rows(global_shape[0], world, coord)
    if not sharded_like_param:  # a whole tensor on every rank: take this rank's rows
        t = t[start:end]
    if list(t.shape) != [end - start] + list(global_shape[1:]):
        raise LayoutMismatchError(
            f"{name}: local shape {list(t.shape)}, but rows [{start}, {end}) of global shape "
            f"{global_shape} by the FSDP2 chunk rule for shard {coord} of {world}: reshard "
            "saves FSDP2 layouts (fully_shard on dim 0)")
    return raw_save_entry(name, t, global_shape, True, start, end)


def flat_info(unit: str, numel: int, aligned_numel: int, params, shared) -> "_C.FlatInfo":
    """An FSDP1 unit's flat object: params as (fqn, key, shape, offset)."""
    return _C.FlatInfo(unit, int(numel), int(aligned_numel),
                       [_C.FlatParam(f, k, [int(d) for d in shape], int(o)) for f, k, shape, o in params],
                       list(shared))


_PAUSE_ENV = "RESHARD_TEST_SAVE_PAUSE"  # test hook: seconds to sleep before each tensor


def save_tensors(path: str, key: str, world: int, coord: int, save_id: int, step, entries,
                 **kw) -> "_C.SaveStats":
    """Writes one rank file atomically from save entries (see raw_save_entry)."""
    pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    _C._testing.set_save_pause(pause)
    return _C.save(path, key, world, coord, save_id, step, list(entries), **kw)


def write_saved_manifest(out: str, world: int, save_id: int, step, aux: List[str], fsdp1=None) -> str:
    return _C.write_saved_manifest(out, world, save_id, step, aux, fsdp1=fsdp1)
