"""The copy engine, as the torch-aware package drives it: this process's reader threads and
CUDA copier (set up once, `prepare`), and the calls that move bytes between rank files and
tensors through the extension (`load_tensors`, `save_tensors`). Everything that turns
tensors into raw (pointer, size) targets is here, so the rest of the package never touches
the binding's calling conventions."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import List, Optional, Sequence, TextIO, Tuple

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
    source: str = "rank file"  # where the bytes came from: the layout's rank file, or what was read instead


    def __str__(self) -> str:  # what a person reads; repr() keeps every field
        where = self.file if self.source == "rank file" else self.source
        return (f"rank {self.rank}/{self.world_size}: loaded {_C.format_bytes(self.bytes)} of {self.layout} "
                f"from {where} in {self.seconds:.3f} s ({_C.format_rate(self.gbps * 1e9)}), "
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


class ProgressLine:
    """A progress line on `stream` for the loads made inside ``with ProgressLine(...)``:
    every load_tensors call adds its bytes to one counter (reshard._C.LoadProgress, which the
    native loader updates as spans land, without the GIL) and a daemon thread rewrites one
    line at most ten times a second: "reshard.load: 1.20 GB / 3.40 GB  12.3 GB/s  ETA 0 s".
    The total is the first rank file's (or view's) tensor bytes, what a load reads. Nothing
    is printed for a load that ends within DELAY seconds, or when disabled."""

    _active: "Optional[ProgressLine]" = None
    DELAY, INTERVAL = 0.5, 0.1  # seconds: before the first line, between lines

    def __init__(self, what: str, enabled: bool = True, stream: Optional[TextIO] = None):
        self.what, self.enabled = what, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.delay, self.interval = ProgressLine.DELAY, ProgressLine.INTERVAL
        self.counter = _C.LoadProgress()
        self.total: Optional[int] = None
        self.shown = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def line(self) -> str:
        done = self.counter.bytes
        total = max(self.total or 0, done)
        s = max(time.perf_counter() - self._t0, 1e-9)
        rate = done / s
        eta = f"  ETA {(total - done) / rate:.0f} s" if rate > 0 and total else ""
        of = f" / {_C.format_bytes(total)}" if total else ""
        return f"{self.what}: {_C.format_bytes(done)}{of}  {_C.format_rate(rate)}{eta}"

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
            self.shown = True
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "ProgressLine":
        if self.enabled:
            self._t0 = time.perf_counter()
            ProgressLine._active = self
            self._thread = threading.Thread(target=self._run, name="reshard-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        ProgressLine._active = None
        self._stop.set()
        self._thread.join()
        if self.shown:
            self.stream.write("\r\033[K" + self.line() + "\n")
            self.stream.flush()


def load_tensors(rank_file: "_C.RankFile", targets: Sequence["_C.LoadTarget"], *, device: int = 0,
                 threads: Optional[int] = None, verify: bool = True, io: str = "auto") -> "_C.LoadStats":
    """Moves rank-file tensors into their targets (on_device ones through this process's CUDA
    copy engine for `device`), counting them on the active ProgressLine, if any."""
    line = ProgressLine._active
    counter = None
    if line is not None:
        counter = line.counter
        if line.total is None:
            line.total = sum(t.nbytes for t in rank_file.tensors)
    return rank_file.load(list(targets), device=device, threads=threads or default_threads(),
                          verify=verify, io=io, progress=counter)


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

@dataclasses.dataclass
class SaveItem:
    """One tensor of a save: what its rank-file entry says (name, dtype, global shape, rows
    of a shard, an FSDP1 flat object) and the tensor holding its bytes, which an
    asynchronous save replaces by its snapshot's copy (`snapshot`)."""
    name: str
    dtype: str
    global_shape: List[int]
    rows: Optional[Tuple[int, int]]
    flat: Optional["_C.FlatInfo"]
    tensor: torch.Tensor
    # DTensor layouts: one placement per mesh dim ("R", "S(d)", "_S(d,k)") and fully_shard's
    # mesh dim (-1: none); the native side derives the entry's local shape from them.
    placements: Optional[List[str]] = None
    fsdp_mesh_dim: int = -1

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def native(self) -> "_C.SaveTensor":
        t = self.tensor
        return _C.SaveTensor(self.name, self.dtype, self.global_shape, self.rows, t.data_ptr(),
                             self.nbytes, t.device.type == "cuda", self.flat, self.placements or [],
                             self.fsdp_mesh_dim)


def raw_save_entry(name: str, t: torch.Tensor, global_shape: List[int], sharded: bool, start: int,
                   end: int, flat: Optional["_C.FlatInfo"] = None) -> Tuple[SaveItem, torch.Tensor]:
    """A save item for `t` stored as it is (the caller has checked its shape; `flat`: an
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
    return SaveItem(name, dtype, [int(d) for d in global_shape], (start, end) if sharded else None,
                    flat, t), t


def save_entry(name: str, t: torch.Tensor, global_shape: List[int], world: int, coord: int,
               sharded_like_param: bool) -> Tuple[SaveItem, torch.Tensor]:
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


def save_tensors(path: str, key: str, world: int, coord: int, save_id: int, step,
                 entries: Sequence[SaveItem], **kw) -> "_C.SaveStats":
    """Writes one rank file atomically from save items (see raw_save_entry)."""
    pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    _C._testing.set_save_pause(pause)
    return _C.save(path, key, world, coord, save_id, step, [e.native() for e in entries], **kw)


def write_saved_manifest(out: str, world: int, save_id: int, step, aux: List[str], fsdp1=None,
                         dtensor=None, parts: Sequence[str] = ()) -> str:
    return _C.write_saved_manifest(out, world, save_id, step, aux, fsdp1=fsdp1, dtensor=dtensor,
                                   parts=list(parts))


# ---- snapshots of asynchronous saves ----------------------------------------------------------

SNAPSHOT_KINDS = ("auto", "device", "host")
_SNAPSHOT_ALIGN = 4096
# A device snapshot is taken only while the job's peak allocation so far plus the snapshot
# stays within this share of the GPU's memory (training must still fit beside it).
DEVICE_SNAPSHOT_SHARE = 0.9


class _HostBuffer:
    """One host allocation of exactly `nbytes`, pinned (registered with CUDA) when asked.
    Registered rather than cudaHostAlloc'd through torch's caching host allocator, which
    rounds an allocation up to a power of two (a 20.2 GB snapshot took 34.4 GB, BENCHMARKS.md)."""

    def __init__(self, nbytes: int, pinned: bool):
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False
        if pinned:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
            if int(err) != 0:
                raise UnsupportedError(f"pinning a {self.tensor.numel()}-byte host snapshot buffer "
                                       f"failed (cudaHostRegister error {int(err)}); pass snapshot=\"device\"")
            self.pinned = True

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None


_host_pool: Optional[_HostBuffer] = None  # the process's host snapshot buffer, reused


def _aligned(n: int) -> int:
    return (n + _SNAPSHOT_ALIGN - 1) // _SNAPSHOT_ALIGN * _SNAPSHOT_ALIGN


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """The process's host snapshot buffer, at least `nbytes` (pinned when `pinned`): one
    allocation, kept and reused by every later snapshot (one asynchronous save is in flight
    at a time), made again when a save needs more. Pinning it costs once per process (the
    pages are faulted in and locked: BENCHMARKS.md)."""
    global _host_pool
    pool = _host_pool
    if pool is not None and pool.tensor.numel() >= nbytes and (pool.pinned or not pinned):
        return pool.tensor
    release_snapshot_buffer()
    _host_pool = _HostBuffer(nbytes, pinned)
    return _host_pool.tensor


def release_snapshot_buffer() -> None:
    """Frees the host buffer that asynchronous saves keep for their snapshots (the next
    asynchronous save allocates it again). A save in flight keeps what it uses."""
    global _host_pool
    if _host_pool is not None:
        _host_pool.release()
    _host_pool = None


def device_snapshot_fits(device: int, nbytes: int) -> bool:
    """A device snapshot of `nbytes` fits: the job's peak allocation so far plus it stays
    within DEVICE_SNAPSHOT_SHARE of the GPU, and the allocator can get it now."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak + nbytes <= DEVICE_SNAPSHOT_SHARE * total and nbytes <= free + cached


def host_snapshot_fits(nbytes: int) -> bool:
    """The host snapshot buffer of `nbytes` exists already, or fits in what the kernel says is
    available (MemAvailable) with a tenth of it to spare."""
    if _host_pool is not None and _host_pool.tensor.numel() >= nbytes:
        return True
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return nbytes <= 0.9 * int(line.split()[1]) * 1024
    except OSError:
        pass
    return True


def snapshot(items: Sequence[SaveItem], where: str = "auto") -> Tuple[str, int]:
    """Copies the bytes of every save item into memory that training does not touch, and
    points the items at the copies, so that the model may change while they are written.
    `where`: "device" (CUDA tensors are copied into new device memory: a device-to-device
    copy), "host" (into the process's one reused host buffer, pinned when any tensor is on
    CUDA), or "auto" (device when device_snapshot_fits, else host). CPU tensors always go to
    the host buffer. Returns (where the copies are: "device" (the CUDA tensors'; CPU ones in
    the host buffer), "host", or "none" for no tensor; bytes copied); on return every copy is
    complete. "auto" returns ("blocking", 0), copying nothing, when the host buffer it needs
    does not fit in the available host memory (host_snapshot_fits): the save is then written
    before the call returns, through the bounded staging of a blocking save."""
    if where not in SNAPSHOT_KINDS:
        raise InvalidArgumentError(f"snapshot={where!r}; expected one of {', '.join(SNAPSHOT_KINDS)}")
    cuda = [it for it in items if it.tensor.device.type == "cuda"]
    devices = {it.tensor.device.index for it in cuda}
    kind = "none"
    if cuda:
        kind = where
        if where == "auto":
            kind = "device" if all(device_snapshot_fits(d, sum(it.nbytes for it in cuda
                                                                if it.tensor.device.index == d))
                                   for d in devices) else "host"
    to_host = [it for it in items if it.tensor.device.type == "cpu" or kind == "host"]
    host_bytes = sum(_aligned(it.nbytes) for it in to_host)
    if where == "auto" and to_host and not host_snapshot_fits(host_bytes):
        return "blocking", 0
    pool = _host_buffer(host_bytes, pinned=kind == "host") if to_host else None
    offset = 0
    with torch.no_grad():
        for it in items:
            t = it.tensor
            if t.device.type == "cuda" and kind == "device":
                it.tensor = t.clone()
                continue
            n = it.nbytes
            dst = pool[offset:offset + n].view(t.dtype).view(t.shape) if n else torch.empty_like(t, device="cpu")
            dst.copy_(t, non_blocking=t.device.type == "cuda")
            it.tensor = dst
            offset += _aligned(n)
    for d in devices:
        torch.cuda.synchronize(d)
    if kind == "none" and to_host:
        kind = "host"
    return kind, sum(it.nbytes for it in items)
