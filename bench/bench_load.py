#!/usr/bin/env python3
"""Benchmark loading one reshard rank file onto a GPU against its ceilings and its peers.

One run, following the fair method of docs/peers-and-performance.md:

1. makes (once, cached in --workdir) a Llama-shaped bf16 checkpoint of about --size-gb GB in
   several safetensors files, with model.safetensors.index.json and a transformers config.json
   (LlamaForCausalLM: vocab 32000, hidden 4096, intermediate 11008, 32 heads, 8 KV heads);
2. `reshard convert`s it for world size 8 and 1 into one OUT;
3. for two cases (--cases) -- "rank": rank --rank of world size 8, "whole": the world-size-1 file (the
   whole model) -- measures, cold (page cache dropped before each run) and warm (files read
   once first, the first timed run of each series discarded), --reps repetitions each:
   * ceilings (tools/bench, reshard_bench_ceilings): sequential read of the rank file cold
     (1 thread, 16 MiB, buffered, and dd-like O_DIRECT), the plain C++ loop (pread -> 2 pinned
     buffers -> cudaMemcpyAsync per thread) cold and warm, a multithreaded page cache -> pinned
     copy warm (16 threads, 2 MiB), pinned host -> device copies;
   * reshard: `reshard._C._testing.load_raw` into preallocated CUDA tensors, --threads each, io=auto, and
     verify=False (warm) to show what checksums cost; "-prepared": the same after
     `_C.prepare` was started (not waited for) before the targets were allocated, as
     reshard.empty_model does in a job (a load that comes first waits for it, in the timer);
   * peers on the same bytes: safe_open row slices of rank r's part + .cuda() (rank case);
     safetensors load_file(device="cuda") (whole case); DCP HuggingFaceStorageReader into an
     FSDP2 LlamaForCausalLM (both cases: rank r of a fake process group of --world-size with
     no_dist=True, or the whole model on a one-process group);
4. checks reshard's bytes against safe_open slices (a sample in every run, all tensors once);
5. prints a table, writes JSON, a text report, a log and a PNG chart into --outdir.

Every measured loader runs in its own child process (its own peak RSS via wait4 and getrusage,
its own GPU memory). Each child imports, creates the CUDA context and allocates what the API
takes preallocated (reshard's targets, DCP's FSDP2 model), drops the page cache itself when the
run is cold, and then times from before the first file is opened until every tensor is in
place and the device is synchronized. GB = 1e9 bytes landed on the GPU.

Usage (repo root, build/ built, PYTHONPATH=python):
  python3 bench/bench_load.py                 # full run, ~4 GB checkpoint, 3 reps
  python3 bench/bench_load.py --quick         # smoke test on the GPU (~0.9 GB, 1 rep)
  python3 bench/bench_load.py --cpu-smoke     # no GPU: CPU-only parts end to end
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from bench_checkpoint import make_checkpoint  # shared generator
from common import (REPO, drop_caches, machine_info, rank_slice, read_files, source_handles,
                    utc_now)

RESULT_TAG = "@@RESULT "

KV_HEADS = 8  # grouped-query attention, as in Llama 3


def convert(reshard: str, src: Path, out: Path, world_sizes, ck_desc: dict, log, chunk_size: int = 0,
            ranks: str = "") -> dict:
    """reshard convert for each world size into one OUT (re-done if the source changed);
    chunk_size: --chunk-size (0: the default); ranks: --ranks A-B ("": all)."""
    stamp = out / "bench-stamp.json"
    st = os.stat(reshard)  # a rebuilt reshard may write another format: convert again
    want = {"source": ck_desc["params"], "reshard": [st.st_size, st.st_mtime_ns]}
    if chunk_size:
        want["chunk_size"] = chunk_size
    if ranks:
        want["ranks"] = ranks
    if out.exists() and (not stamp.exists() or json.loads(stamp.read_text()) != want):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    res = {}
    for w in world_sizes:
        t0 = time.perf_counter()
        p = subprocess.run([reshard, "convert", str(src), "-o", str(out), "--world-size", str(w), "--json",
                            *(["--chunk-size", str(chunk_size)] if chunk_size else []),
                            *(["--ranks", ranks] if ranks else [])],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"bench_load: reshard convert --world-size {w} failed "
                             f"(exit {p.returncode}):\n{p.stderr.strip()[-3000:]}")
        j = {}
        try:
            j = json.loads(p.stdout)
        except json.JSONDecodeError:
            pass
        res[f"ws{w}"] = {"wall_seconds": round(time.perf_counter() - t0, 2),
                         "summary": {k: j[k] for k in ("seconds", "bytes_stored", "bytes_decoded")
                                     if k in j}}
        log(f"convert: world size {w}: {res[f'ws{w}']['wall_seconds']} s")
    stamp.write_text(json.dumps(want))
    os.sync()
    return res


def convert_dtensor(reshard: str, src: Path, out: Path, mesh: str, rank: int, workdir: Path, log,
                    chunk_size: int = 0):
    """The plan of transformers' own tp plan of the checkpoint's model, fully_shard over the
    first mesh dim, and `reshard convert --mesh MESH --plan` into OUT (kept while it exists).
    Returns (rank `rank`'s file, the conversion's record)."""
    dp = mesh.split(",")[0].split("=")[0]
    plan = workdir / "bench_tp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "reshard.parallel_plan", str(src), "-o", str(plan), "--fsdp", dp],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"bench_load: python -m reshard.parallel_plan failed:\n{p.stderr.strip()[-3000:]}")
    t0 = time.perf_counter()
    # Only rank `rank`'s file (--ranks): the other coordinates are not timed, and the GPU
    # machine's disk holds the source, two FSDP2 layouts and this one only so.
    p = subprocess.run([reshard, "convert", str(src), "-o", str(out), "--mesh", mesh, "--plan", str(plan),
                        "--ranks", f"{rank}-{rank}", *(["--chunk-size", str(chunk_size)] if chunk_size else [])],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"bench_load: reshard convert --mesh {mesh} failed:\n{p.stderr.strip()[-3000:]}")
    layouts = json.loads((out / "reshard.json").read_text())["layouts"]
    keys = [k for k, v in layouts.items() if v.get("kind") == "dtensor" and "-bench_tp." in k
            and k.startswith("dtensor-" + mesh.replace("=", "").replace(",", ".") + "-")]
    if len(keys) != 1:
        raise SystemExit(f"bench_load: expected one dtensor layout of mesh {mesh} in {out}, found {keys}")
    listed = [r for r in layouts[keys[0]].get("ranks", []) if r.get("rank") == rank]
    if len(listed) != 1:
        raise SystemExit(f"bench_load: layout {keys[0]} of {out} lists no rank file of rank {rank}")
    f = out / layouts[keys[0]].get("dir", keys[0]) / listed[0]["file"]
    log(f"convert: {keys[0]}: {time.perf_counter() - t0:.1f} s; rank {rank}: {f.name}")
    return str(f), {"layout": keys[0], "wall_seconds": round(time.perf_counter() - t0, 2), "rank_file": str(f)}


def _check_dtensor(loaded: dict, src: Path, rank_file: str, mode: str) -> dict:
    """Compares loaded tensors byte for byte with the source's elements this mesh coordinate
    holds (reshard's element map, checked against torch's own DTensors by the tests)."""
    import torch
    from reshard import _C

    if mode == "none" or not loaded:
        return {"mode": mode}
    header = json.loads(_C._testing.read_header(rank_file))
    layout = header["layout"]
    shape, coord = layout["mesh"]["shape"], header["coordinate"]
    entries = {e["name"]: e for e in header["tensors"]}
    weight_map, handles = source_handles(src)
    names = list(loaded)
    if mode == "sample":
        pick = [names[0], names[-1], names[len(names) // 2]]
        pick += [n for n in names if n.endswith("o_proj.weight")][-1:]
        pick += [n for n in names if n.endswith("k_proj.weight")][-1:]
        names = list(dict.fromkeys(pick))
    problems, checked, checked_bytes = [], 0, 0
    for name in names:
        e = entries[name]
        full = handles[weight_map[name]].get_tensor(name)
        fsdp = e.get("fsdp_mesh_dim")
        runs = _C.dtensor_local_indices(list(full.shape), e["placements"], shape, coord, -1 if fsdp is None else fsdp)
        ref = full
        for d, r in enumerate(runs):
            ref = ref.index_select(d, torch.tensor([i for b, n in r for i in range(b, b + n)], dtype=torch.int64))
        got = loaded[name].detach().cpu()
        if list(got.shape) != list(ref.shape) or not torch.equal(got.reshape(-1).view(torch.uint8),
                                                                 ref.contiguous().reshape(-1).view(torch.uint8)):
            problems.append(f"{name}: differs from the source's elements of coordinate {coord}")
        checked += 1
        checked_bytes += got.numel() * got.element_size()
    return {"mode": mode, "ok": not problems, "checked": checked, "checked_bytes": checked_bytes,
            "problems": problems[:5]}


def rank_file(out: Path, ws: int, r: int) -> Path:
    return out / f"fsdp2-ws{ws}" / f"rank-{r:05d}-of-{ws:05d}.reshard"


# ============================================================================================
# page cache helpers (parent and children)
# ============================================================================================
def residency(paths) -> float:
    """Fraction of the files' pages in the page cache (mmap + mincore, no page touched)."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        n = (size + page - 1) // page
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                continue
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) == 0:
                resident += sum(v & 1 for v in vec)
                total += n
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


class RuntimeKeeper:
    """Keeps the children's runtime files (Python modules, torch/CUDA libraries) mapped in the
    parent with MAP_POPULATE, so `drop_caches` (which skips mapped pages) evicts the checkpoint
    data but not the interpreter's libraries: every child then starts in seconds even right
    after a drop. Only the children's start-up (untimed) is affected."""

    def __init__(self, exclude: list[Path]):
        self.maps = {}
        self.bytes = 0
        self.exclude = [str(p.resolve()) for p in exclude]

    def add(self, files):
        import mmap as _mmap

        flags = _mmap.MAP_SHARED | getattr(_mmap, "MAP_POPULATE", 0)
        for f in files:
            if f in self.maps or any(f.startswith(e) for e in self.exclude):
                continue
            try:
                size = os.path.getsize(f)
                if size == 0:
                    continue
                with open(f, "rb") as fh:
                    self.maps[f] = _mmap.mmap(fh.fileno(), 0, flags=flags, prot=_mmap.PROT_READ)
                self.bytes += size
            except (OSError, ValueError):
                continue


def runtime_files() -> list[str]:
    """Files this process has mapped or imported (for RuntimeKeeper)."""
    import importlib.util

    files = set()
    try:
        for line in open("/proc/self/maps"):
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                files.add(parts[5].strip())
    except OSError:
        pass
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if not f:
            continue
        files.add(f)
        if f.endswith(".py"):
            try:
                c = importlib.util.cache_from_source(f)
                files.add(c)
            except (NotImplementedError, ValueError):
                pass
    bad = ("/dev/", "/proc/", "/sys/", "/memfd:", "/SYSV")
    return sorted(f for f in files
                  if not f.startswith(bad) and not f.endswith("(deleted)") and os.path.isfile(f))


# ============================================================================================
# child process: one measured load
# ============================================================================================
def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _check(loaded: dict, src: Path, ws: int, rank: int, mode: str) -> dict:
    """Compares loaded tensors byte for byte with safe_open row slices of the source."""
    import torch

    if mode == "none" or not loaded:
        return {"mode": mode}
    weight_map, handles = source_handles(src)
    names = list(loaded)
    if mode == "sample":
        layer_names = [n for n in names if ".layers." in n]
        pick = [names[0], names[-1], names[len(names) // 2]]
        pick += [n for n in layer_names if n.endswith("k_proj.weight")][-1:]
        pick += [n for n in layer_names if n.endswith("input_layernorm.weight")][:1]
        names = list(dict.fromkeys(pick))
    problems, checked, checked_bytes = [], 0, 0
    for name in names:
        if name not in weight_map:
            problems.append(f"{name}: not in the source")
            continue
        ref = rank_slice(handles[weight_map[name]], name, ws, rank)
        got = loaded[name]
        if hasattr(got, "to_local"):
            got = got.to_local()
        got = got.detach().cpu()
        if list(got.shape) != list(ref.shape) or got.dtype != ref.dtype:
            problems.append(f"{name}: {list(got.shape)} {got.dtype}, source slice "
                            f"{list(ref.shape)} {ref.dtype}")
            continue
        if not torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
            problems.append(f"{name}: bytes differ from the source slice")
        checked += 1
        checked_bytes += got.numel() * got.element_size()
    return {"mode": mode, "ok": not problems, "checked": checked, "checked_bytes": checked_bytes,
            "problems": problems[:5]}


class ReshardLoad:
    """reshard._C._testing.load_raw of one rank file into preallocated tensors."""

    def __init__(self, spec, device):
        import torch
        from reshard import _C
        from reshard.layout import torch_dtype

        self.torch, self._C, self.spec, self.device = torch, _C, spec, device
        if spec.get("prepare") and device.type == "cuda":
            # As reshard.empty_model does in a job: the copy engine's set-up starts on a
            # background thread while the model (here: the targets) is allocated. A load that
            # comes before it has finished waits for it inside the timer.
            _C.prepare(device.index or 0, spec["threads"], wait=False)
        if spec.get("preload_file"):
            # Diagnostic: another rank file loaded first, untimed (is a fresh process's first
            # load slower because of the process or because of the file?).
            pre = json.loads(_C._testing.read_header(spec["preload_file"]))
            keep = [torch.empty(max(e["nbytes"], 1), dtype=torch.uint8, device=device) for e in pre["tensors"]]
            _C._testing.load_raw(spec["preload_file"], [(e["name"], t.data_ptr(), e["nbytes"], device.type == "cuda")
                                           for e, t in zip(pre["tensors"], keep)],
                    device=spec.get("cuda_device", 0), threads=spec["threads"], io="auto")
            torch.cuda.synchronize() if device.type == "cuda" else None
            del keep
        self.files = [spec["rank_file"]]
        header = json.loads(_C._testing.read_header(spec["rank_file"]))  # shapes for the targets
        self.tensors = {}
        for e in header["tensors"]:
            self.tensors[e["name"]] = torch.empty(e["local_shape"], dtype=torch_dtype(e["dtype"]),
                                                  device=device)
        if spec.get("zero_targets"):
            # Diagnostic: the destinations written once on the device before the timer (is
            # it fresh device memory that makes a process's first load slower?).
            for t in self.tensors.values():
                t.zero_()
        self.targets = [(n, t.data_ptr(), t.numel() * t.element_size(), device.type == "cuda")
                        for n, t in self.tensors.items()]

    def run(self):
        s = self.spec
        self.report = self._C._testing.load_raw(s["rank_file"], self.targets, device=s.get("cuda_device", 0),
                                   threads=s["threads"], verify=s["verify"], io=s["io"])
        return self.tensors

    def extra(self):
        r = dict(self.report)
        out = {"loader_report": r, "pinned_bytes": r.get("staging_bytes", 0),
               "staging_alloc_seconds": r.get("staging_alloc_seconds", 0.0)}
        if self.spec.get("second_load"):
            # Same process, same data again: the steady-state cost without one-time set-up
            # (copier streams and pinned staging are cached per process). `more_loads` (a
            # diagnostic) repeats it, to see whether loads keep getting faster.
            out["more_loads"] = []
            for _ in range(max(1, int(self.spec.get("more_loads", 1)))):
                if self.spec.get("between_argv"):  # diagnostic: e.g. push the CPU caches out
                    subprocess.run(self.spec["between_argv"], check=True, stdout=subprocess.DEVNULL)
                t0 = time.perf_counter()
                self.run()
                if self.device.type == "cuda":
                    self.torch.cuda.synchronize()
                out["more_loads"].append({"seconds": time.perf_counter() - t0, "report": dict(self.report)})
            out["second_load_seconds"] = out["more_loads"][0]["seconds"]
        return out


class ReshardView:
    """reshard's load of rank r straight from what is there, when OUT has no rank file of this
    world size (reshard._C.SourceRankView, what reshard.load uses then): the Hugging Face
    checkpoint itself (view=checkpoint), or another layout of OUT (view=fsdp2-wsN). Targets
    preallocated as for ReshardLoad; the planning (opening the source, its headers) is in the
    timer, as in reshard.load."""

    def __init__(self, spec, device):
        import torch
        from reshard import _C
        from reshard.layout import torch_dtype

        self.torch, self._C, self.spec, self.device = torch, _C, spec, device
        if spec.get("prepare") and device.type == "cuda":
            _C.prepare(device.index or 0, spec["threads"], wait=False)
        view = self._open()
        self.files = list(view.files)
        self.tensors = {t.name: torch.empty(t.local_shape, dtype=torch_dtype(t.dtype), device=device)
                        for t in view.tensors}

    def _open(self):
        s = self.spec
        if s["view"] == "checkpoint":
            return self._C.SourceRankView.of_checkpoint(s["src"], s["ws"], s["rank"])
        return self._C.SourceRankView.of_layout(s["out"], s["view"], s["ws"], s["rank"])

    def run(self):
        t0 = time.perf_counter()
        view = self._open()
        t1 = time.perf_counter()
        targets = [self._C.LoadTarget(n, t.data_ptr(), t.numel() * t.element_size(), self.device.type == "cuda")
                   for n, t in self.tensors.items() if t.numel()]
        self.report = view.load(targets, device=self.spec.get("cuda_device", 0), threads=self.spec["threads"],
                                verify=self.spec.get("verify", True), io=self.spec.get("io", "auto"))
        # Phases of the user's call (diagnostics): opening and planning the view, then its load.
        self.phases = {"open_s": t1 - t0, "load_s": time.perf_counter() - t1}
        return self.tensors

    def extra(self):
        r = self.report
        out = {"loader_report": {"bytes": r.bytes, "stored_bytes": r.stored_bytes, "seconds": r.seconds,
                                 "threads": r.threads, "staging_bytes": r.staging_bytes, "cold": r.cold,
                                 "direct_io": r.direct_io},
               "pinned_bytes": r.staging_bytes, "staging_alloc_seconds": r.staging_alloc_seconds,
               "view_phases": dict(getattr(self, "phases", {}))}
        if self.spec.get("second_load"):
            t0 = time.perf_counter()
            self.run()
            if self.device.type == "cuda":
                self.torch.cuda.synchronize()
            out["second_load_seconds"] = time.perf_counter() - t0
            out["more_loads"] = [{"seconds": out["second_load_seconds"], "report": dict(out["loader_report"])}]
            out["view_phases_second"] = dict(self.phases, loader_seconds=self.report.seconds)
        return out


class SafeOpenSlices:
    """What a user writes without reshard: safe_open each source file, take this rank's rows of
    every tensor with get_slice, move it to the GPU."""

    def __init__(self, spec, device):
        import torch
        from safetensors import safe_open  # noqa: F401

        self.torch, self.spec, self.device = torch, spec, device
        self.src = Path(spec["src"])
        self.files = sorted(str(p) for p in self.src.glob("*.safetensors"))

    def run(self):
        ws, r = self.spec["ws"], self.spec["rank"]
        weight_map, handles = source_handles(self.src)
        out = {}
        for name, f in weight_map.items():
            t = rank_slice(handles[f], name, ws, r)
            # On the CPU (--cpu-smoke) the slice may still point into the mmap: copy it so the
            # bytes really land in private memory, as .cuda() does on the GPU.
            out[name] = t.cuda() if self.device.type == "cuda" else t.clone()
        return out

    def extra(self):
        return {}


class LoadFile:
    """safetensors.torch.load_file(f, device=...) of every source file (the whole model)."""

    def __init__(self, spec, device):
        import torch
        from safetensors.torch import load_file  # noqa: F401

        self.torch, self.spec, self.device = torch, spec, device
        self.files = sorted(str(p) for p in Path(spec["src"]).glob("*.safetensors"))

    def run(self):
        from safetensors.torch import load_file

        out = {}
        dev = "cuda" if self.device.type == "cuda" else "cpu"
        for f in sorted(str(p) for p in Path(self.spec["src"]).glob("*.safetensors")):
            part = load_file(f, device=dev)
            if dev == "cpu":  # (--cpu-smoke) CPU tensors map the file: copy to land the bytes
                part = {k: v.clone() for k, v in part.items()}
            out.update(part)
        return out

    def extra(self):
        return {}


class DcpFsdp2:
    """torch.distributed.checkpoint.load with HuggingFaceStorageReader into an FSDP2
    LlamaForCausalLM (built on meta, fully_shard per layer and at the root, to_empty on the
    device). World size 1 (the whole case): a real single-process process group. Rank r of a
    larger world size (the rank case): this one process is rank r of a "fake" process group
    (torch's FakeStore, as torch's own FSDP tests use), so the model holds exactly rank r's
    FSDP2 shards, and dcp.load(no_dist=True) plans and reads only those (the reader reads
    each with safe_open's get_slice): what one rank of a real job does, less the collectives
    that exchange the plans and the closing all_gather that waits for the slowest rank,
    which a real job pays on top."""

    def __init__(self, spec, device):
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoConfig, LlamaForCausalLM
        import safetensors.torch  # noqa: F401  (imported lazily by the reader)
        import torch.distributed.checkpoint.default_planner  # noqa: F401

        self.torch, self.dist, self.dcp, self.spec, self.device = torch, dist, dcp, spec, device
        self.src = Path(spec["src"])
        self.files = sorted(str(p) for p in self.src.glob("*.safetensors"))
        gpu = device.type == "cuda"
        self.ws, self.rank = int(spec.get("ws", 1)), int(spec.get("rank", 0))
        self.backend_note = None
        if self.ws > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            self.backend = "fake"
            dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.ws)
        else:
            self.backend = "cpu:gloo,cuda:nccl" if gpu else "gloo"
            try:
                self._init_pg(self.backend, device)
            except Exception as e:  # noqa: BLE001  (NCCL refused: no collective runs on GPU data)
                if not gpu:
                    raise
                self.backend_note = f"NCCL process group failed ({type(e).__name__}: {e}); used gloo"
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass
                self.backend = "gloo"
                self._init_pg(self.backend, None)
        mesh = init_device_mesh(device.type, (self.ws,))
        config = AutoConfig.from_pretrained(str(self.src))
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)
        self.model = model
        self.state_dict = model.state_dict()

    def _init_pg(self, backend, device):
        torch, dist = self.torch, self.dist
        kw = {"device_id": device} if device is not None and device.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
        # Warm the process group (communicators, object collectives) outside the timer: a
        # training job has it up before it loads.
        probe = torch.ones(1, device=device if "nccl" in backend else "cpu")
        dist.all_reduce(probe)
        dist.all_gather_object([None], 0)

    def run(self):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        reader = HuggingFaceStorageReader(str(self.src), thread_count=self.spec["dcp_threads"])
        self.dcp.load(self.state_dict, storage_reader=reader, no_dist=self.ws > 1)
        return self.state_dict

    def extra(self):
        out = {"dcp_thread_count": self.spec["dcp_threads"], "process_group": self.backend,
               "world_size": self.ws, "rank": self.rank}
        if self.backend_note:
            out["note"] = self.backend_note
        return out

    def close(self):
        try:
            self.dist.destroy_process_group()
        except Exception:
            pass


KINDS = {"reshard": ReshardLoad, "view": ReshardView, "slices": SafeOpenSlices, "load_file": LoadFile,
         "dcp": DcpFsdp2}


def _tensor_bytes(loaded: dict) -> int:
    total = 0
    for t in loaded.values():
        if hasattr(t, "to_local"):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def child_main(spec: dict) -> int:
    out = {"ok": False, "kind": spec["kind"], "cold": spec["cold"]}
    t_child = time.perf_counter()
    loader = None
    try:
        import resource

        import torch

        gpu = spec["device"] == "cuda"
        if gpu:
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available in the child process")
            device = torch.device("cuda", spec.get("cuda_device", 0))
            torch.cuda.set_device(device)
            torch.empty(1, device=device)  # the CUDA context, outside the timer
            torch.cuda.synchronize()
        else:
            device = torch.device("cpu")
        for k, v in (spec.get("env") or {}).items():  # knobs of a diagnostic series
            os.environ[k] = str(v)
        t_setup = time.perf_counter()
        if gpu:
            free0 = torch.cuda.mem_get_info(device)[0]
        loader = KINDS[spec["kind"]](spec, device)
        if gpu:
            torch.cuda.synchronize()
        out["setup_seconds"] = {"import_and_context": round(t_setup - t_child, 3),
                                "prepare": round(time.perf_counter() - t_setup, 3)}
        if spec["cold"]:
            why = drop_caches()
            if why:
                raise RuntimeError(why)
        if spec.get("no_probe"):
            # Diagnostic: no whole-file mincore walk just before the timer (the loader's own
            # 64-sample probe still runs inside it, and reports what it found).
            out["resident_fraction_before"] = None
        else:
            out["resident_fraction_before"] = round(residency(loader.files), 4)
        out["rss_before_kib"] = _status_kib("VmHWM")
        if spec.get("pre_argv"):  # diagnostic: e.g. every core kept busy just before the timer
            subprocess.run(spec["pre_argv"], check=True, stdout=subprocess.DEVNULL)

        if gpu:  # what the timed run itself allocates on the device, and frees or keeps
            alloc_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loaded = loader.run()
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0

        # VmHWM: this process's own high-water mark (exec starts a fresh one). getrusage's
        # ru_maxrss would include the spawning process's RSS, which Linux carries into the
        # child's maxrss at exec when the parent forks with vfork (as subprocess does).
        out["rss_peak_load_kib"] = _status_kib("VmHWM")
        out["rss_maxrss_getrusage_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["rss_anon_after_kib"] = _status_kib("RssAnon")
        out["rss_file_after_kib"] = _status_kib("RssFile")
        weights = _tensor_bytes(loaded)
        out.update({"seconds": seconds, "bytes": weights, "tensors": len(loaded),
                    "gbps": weights / seconds / 1e9 if seconds > 0 else 0.0})
        if gpu:
            free1 = torch.cuda.mem_get_info(device)[0]
            peak_alloc = torch.cuda.max_memory_allocated(device)
            peak_res = torch.cuda.max_memory_reserved(device)
            alloc_after = torch.cuda.memory_allocated(device)
            # Torch's caching allocator only (not cudaMalloc or pinned host memory; reshard's
            # staging is pinned host memory made by prepare). extra_allocated_peak counts the
            # allocator's rounding of the weights' own blocks (e.g. a 43 MiB tensor gets a
            # whole 44 MiB segment); transient_peak is what the run allocated on top of what
            # it started and ended with (temporaries), whoever allocated the weights. The peak
            # is reset just before the timer (runs before 2026-11-30 run S reset it before the
            # loader's set-up, so a diagnostic's untimed preload counted too).
            out["gpu"] = {"weights_bytes": weights,
                          "transient_peak": peak_alloc - max(alloc_before, alloc_after),
                          "extra_allocated_peak": peak_alloc - weights,
                          "extra_reserved_peak": peak_res - weights,
                          "extra_meminfo_after": (free0 - free1) - weights}
            try:
                hs = torch.cuda.host_memory_stats()
                out["torch_pinned_peak_bytes"] = hs.get("allocated_bytes.peak",
                                                        hs.get("allocated_bytes.all.peak", 0))
            except Exception:
                pass
        out.update(loader.extra())
        if spec.get("dtensor"):
            out["check"] = _check_dtensor(loaded, Path(spec["src"]), spec["rank_file"], spec["check"])
        else:
            out["check"] = _check(loaded, Path(spec["src"]), spec["ws"], spec["rank"], spec["check"])
        if spec.get("probe"):
            out["runtime_files"] = runtime_files()
        out["ok"] = out["check"].get("ok", True)
        if not out["ok"]:
            out["error"] = "correctness check failed: " + "; ".join(out["check"]["problems"])
    except BaseException as e:  # report every failure as JSON
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if loader is not None and hasattr(loader, "close"):
            loader.close()
    print(RESULT_TAG + json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


# ============================================================================================
# parent
# ============================================================================================
def _spawn(cmd, env, timeout, out_path, err_path) -> dict:
    """Runs cmd with stdout/stderr to files; returns wall, maxrss (wait4), rc, timed_out."""
    with open(out_path, "wb") as so, open(err_path, "wb") as se:
        t0 = time.perf_counter()
        try:
            p = subprocess.Popen(cmd, stdout=so, stderr=se, env=env)
        except OSError as e:
            se.write(f"cannot start {cmd[0]}: {e}\n".encode())
            return {"wall": 0.0, "maxrss_kib": 0, "rc": 127, "timed_out": False}
        killed = []
        timer = threading.Timer(timeout, lambda: (killed.append(1), p.kill()))
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        return {"wall": time.perf_counter() - t0, "maxrss_kib": ru.ru_maxrss, "rc": p.returncode,
                "timed_out": bool(killed)}


def spawner_main() -> int:
    """A small process, started before the benchmark imports torch or maps anything, that
    starts every measured child. Linux carries the spawning process's RSS high-water mark into
    a vforked child's ru_maxrss; spawned from here it is this process's few MiB, not the
    parent's gigabytes, so wait4's ru_maxrss is the child's own peak (give or take that)."""
    for line in sys.stdin:
        req = json.loads(line)
        try:
            res = _spawn(req["cmd"], req["env"], req["timeout"], req["out"], req["err"])
        except Exception as e:  # noqa: BLE001
            res = {"spawn_error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()
    return 0


class Spawner:
    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="bench-load-")
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_spawner"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  bufsize=1)
        self.n = 0

    def run(self, cmd, env, timeout) -> dict:
        self.n += 1
        out = os.path.join(self.tmp, f"{self.n}.out")
        err = os.path.join(self.tmp, f"{self.n}.err")
        self.p.stdin.write(json.dumps({"cmd": [str(c) for c in cmd], "env": env,
                                       "timeout": timeout, "out": out, "err": err}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the spawner process died (exit {self.p.poll()})")
        res = json.loads(line)
        if "spawn_error" in res:
            raise RuntimeError("spawner: " + res["spawn_error"])
        for key, path in (("stdout", out), ("stderr", err)):
            with open(path, "rb") as f:
                res[key] = f.read().decode(errors="replace")
            os.unlink(path)
        return res

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


SPAWNER: Spawner | None = None


def run_child(cmd, env=None, timeout=600):
    """Runs cmd (through SPAWNER when started); returns dict(wall, maxrss_kib, rc, stdout,
    stderr, timed_out)."""
    env = dict(os.environ if env is None else env)
    if SPAWNER is not None:
        return SPAWNER.run(cmd, env, timeout)
    with tempfile.TemporaryDirectory() as d:
        res = _spawn(cmd, env, timeout, os.path.join(d, "o"), os.path.join(d, "e"))
        for key, name in (("stdout", "o"), ("stderr", "e")):
            with open(os.path.join(d, name), "rb") as f:
                res[key] = f.read().decode(errors="replace")
        return res


def parse_result(stdout: str):
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return None


class Bench:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.outdir = Path(args.outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.outdir / "bench-load.log"
        self.log_file = open(self.log_path, "w")
        self.json_path = Path(args.json_out) if args.json_out else self.outdir / "bench-load.json"
        self.png_path = Path(args.png) if args.png else self.outdir / "bench-load.png"
        self.txt_path = self.outdir / "bench-load.txt"
        self.runs = []  # every run, raw
        self.errors = {}  # series id -> first error
        self.notes = []
        self.result = {}

    def log(self, msg, quiet=False):
        line = f"[{time.perf_counter() - self.t_start:7.1f}s] {msg}"
        if not quiet:
            print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def elapsed(self):
        return time.perf_counter() - self.t_start

    def save_json(self):
        self.result["runs"] = self.runs
        self.result["errors"] = self.errors
        self.result["notes"] = self.notes
        self.result["elapsed_seconds"] = round(self.elapsed(), 1)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.json_path)


def summarize(values):
    """median / min / max of GB/s values."""
    if not values:
        return None
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child_main(json.loads(argv[1]))
    if argv and argv[0] == "_spawner":
        return spawner_main()

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--size-gb", type=float, default=None, help="checkpoint size (default 4; 0.9 with --quick/--cpu-smoke)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per series (default 3; 1 with --quick/--cpu-smoke)")
    ap.add_argument("--rank", type=int, default=0, help="rank of world size --world-size measured (default 0)")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=0,
                    help="--chunk-size of every conversion (0: reshard convert's default): the rank "
                         "file's and the --view-ws layout's chunk, to time both at another chunk size")
    ap.add_argument("--view-chunk-size", type=int, default=0,
                    help="also convert the --view-ws layout with this --chunk-size into its own OUT and time "
                         "the rank's load from it (series reshard-wsNc-tT-prepared): how much of a load from "
                         "another layout goes to whole chunks read for part of their bytes")
    ap.add_argument("--alt-chunk-size", type=int, default=0,
                    help="also convert the timed rank's own file (only that rank, --ranks R-R) with this "
                         "--chunk-size into its own OUT and time it (series reshard-rc-tT-prepared): the "
                         "rank file at two chunk sizes in one run")
    ap.add_argument("--view-ws", type=int, default=4,
                    help="also convert this world size and read the rank case from it (0: no)")
    ap.add_argument("--mesh", default="",
                    help="also convert a DTensor layout of this mesh (e.g. dp_shard=4,tp=2: as many ranks as "
                         "--world-size) with transformers' own tp plan of the model (python -m "
                         "reshard.parallel_plan --fsdp <first mesh dim>) and time its rank --rank file "
                         "(series reshard-2d-tN-prepared), issue 22")
    ap.add_argument("--cases", default="rank,whole",
                    help="what is measured: rank (rank --rank of --world-size), whole (the world-size-1 "
                         "file) or both (default); leaving whole out skips its conversion")
    ap.add_argument("--threads", default="8,16", help="reshard loader threads, comma separated (default 8,16)")
    ap.add_argument("--dcp-threads", type=int, default=1, help="HuggingFaceStorageReader thread_count (default 1, its default)")
    ap.add_argument("--workdir", default=str(REPO / ".work" / "bench-load"))
    ap.add_argument("--outdir", default=None, help="results (default $OUT if set, else WORKDIR/results)")
    ap.add_argument("--json-out", default=None, help="JSON path (default OUTDIR/bench-load.json)")
    ap.add_argument("--png", default=None, help="chart path (default OUTDIR/bench-load.png)")
    ap.add_argument("--build-dir", default=str(REPO / "build"), help="where reshard and tools/bench were built")
    ap.add_argument("--only", default=None, help="comma-separated series labels to run: ceil-seq-read, ceil-seq-direct, "
                         "ceil-pipeline, ceil-read-pinned, ceil-h2d, reshard-t8, reshard-t16, "
                         "reshard-t16-noverify, reshard-t16-prepared, safe_open-slices, load_file, "
                         "dcp-fsdp2; diagnostics, run only when named here: reshard-t16-prepared-nowarm "
                         "(no warm-up in prepare), reshard-t16-prepared-spin (every core busy for 30 ms "
                         "just before the timer), reshard-t16-prepared-env (with --diag-env), "
                         "reshard-t16-prepared-6loads (six loads in one process), "
                         "reshard-t16-prepared-otherfile (another rank file loaded first, untimed), "
                         "reshard-t16-prepared-noprobe (no whole-file mincore just before the timer), "
                         "reshard-t16-prepared-zeroed (destinations zeroed on the device first), "
                         "reshard-t16-prepared-flushed (CPU caches flushed before every load)")
    ap.add_argument("--no-cold", action="store_true", help="skip cold-cache runs")
    ap.add_argument("--no-warm", action="store_true", help="skip warm runs (and the warm-up pass)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start a further repetition only if it is expected to end within this "
                         "many seconds from the start (the first always runs) (default 450 for a "
                         "full run; 0 = no limit)")
    ap.add_argument("--no-keep-runtime", action="store_true",
                    help="do not keep the children's libraries mapped across page-cache drops")
    ap.add_argument("--quick", action="store_true", help="smoke test: ~0.9 GB, 1 repetition")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: generation, convert, host loads with _C._testing.load_raw(on_device=False), "
                         "safe_open slices, load_file and DCP on CPU, and the read ceiling")
    ap.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    ap.add_argument("--diag-env", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="environment of a diagnostic series; each use is one more series: "
                         "reshard-tN-prepared-env, -env2, -env3, ..., e.g. --diag-env RESHARD_STREAMS=1 "
                         "--diag-env RESHARD_STREAMS=4; for the HF view's series (reshard-hf-tN-prepared-env*) "
                         "io=auto|direct|readahead|buffered and threads=N are its load's arguments, not "
                         "environment")
    ap.add_argument("--flush-cpu-caches", type=int, default=0, metavar="MIB",
                    help="before every warm run, write and read MIB MiB in another process "
                         "(reshard_bench_ceilings flush): a ceiling tool then starts as cold in "
                         "the CPU caches as a Python child does after its start-up, instead of "
                         "inheriting the page cache's metadata the previous run left there "
                         "(default 0: off)")
    args = ap.parse_args(argv)
    for group in args.diag_env:
        for kv in group.split(","):
            if kv and ("=" not in kv or not kv.split("=", 1)[0]):
                ap.error(f"--diag-env {group!r}: {kv!r} is not KEY=VALUE")

    small = args.quick or args.cpu_smoke
    if args.size_gb is None:
        args.size_gb = 0.9 if small else 4.0
    if args.reps is None:
        args.reps = 1 if small else 3
    if args.budget_s is None:
        args.budget_s = 0 if small else 450
    if args.outdir is None:
        args.outdir = os.environ.get("OUT") or str(Path(args.workdir) / "results")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    threads = sorted({int(t) for t in args.threads.split(",") if t.strip()})
    if not threads or min(threads) < 1:
        ap.error("--threads: give positive integers, e.g. 8,16")
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        ap.error("--rank must be in [0, --world-size)")

    global SPAWNER
    SPAWNER = Spawner()  # first, while this process is still small (see spawner_main)
    b = Bench(args)
    try:
        return run_bench(b, args, threads)
    finally:
        b.save_json()
        b.log_file.close()
        SPAWNER.close()


def run_bench(b: Bench, args, threads) -> int:
    log = b.log
    build = Path(args.build_dir)
    reshard = build / "reshard"
    ceilings = build / "tools" / "bench" / "reshard_bench_ceilings"
    gpu = not args.cpu_smoke
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    # ---- preflight ----------------------------------------------------------------------------
    if not reshard.exists():
        raise SystemExit(f"bench_load: {reshard} not found; build first (scripts/setup.sh) or pass --build-dir")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    sys.path.insert(0, str(REPO / "python"))
    try:
        from reshard import _C
    except ImportError as e:
        raise SystemExit(f"bench_load: cannot import reshard._C ({e}); build the extension "
                         "(scripts/setup.sh) with this python3, and run with PYTHONPATH=python")
    import torch

    info = _C.build_info()
    if gpu:
        if not torch.cuda.is_available():
            raise SystemExit(
                "bench_load: CUDA is not available here (torch.cuda.is_available() is False): this "
                "benchmark measures loads onto a GPU. Use --cpu-smoke to run the CPU-only parts "
                "(generation, convert, host loads, safe_open slices, read ceilings).")
        if not info.get("cuda"):
            raise SystemExit("bench_load: this reshard._C was built without CUDA; rebuild with a CUDA toolkit")
    have_tool = ceilings.exists()
    if not have_tool:
        msg = (f"{ceilings} not found (tools/bench is built only with RESHARD_WITH_CUDA); "
               "ceilings skipped")
        if gpu:
            raise SystemExit("bench_load: " + msg)
        b.notes.append(msg)
        log(msg)

    b.result.update({
        "date_utc": utc_now(),
        "command": " ".join(["bench/bench_load.py", *map(shlex.quote, sys.argv[1:])]),
        "mode": "cpu-smoke" if args.cpu_smoke else ("quick" if args.quick else "full"),
        "reshard_build": info, "torch": torch.__version__,
        "machine": machine_info(workdir),
        "method": ("GB = 1e9 bytes landed in the destination tensors. Each timed run is a fresh "
                   "child process: imports, CUDA context and the destinations an API takes "
                   "preallocated (reshard targets, sized from the rank file's header; DCP's FSDP2 "
                   "model and its warmed process group) are set up first; a cold run then drops "
                   "the page cache (sync; echo 3 > drop_caches); the timer runs from before the "
                   "loader opens its first file until every tensor is in place and the device is "
                   "synchronized. Warm: files read once first (again after every cold pass), the "
                   "first run of each series discarded, a run that finds its file evicted is "
                   "discarded and repeated. Medians with min/max over --reps. Peak RSS is the "
                   "child's VmHWM at the end of the timed load; children are started by a small "
                   "spawner process so that wait4's ru_maxrss is not inflated by this script's "
                   "own RSS. Libraries the children map are kept mapped by this script so that "
                   "dropping the page cache does not slow the children's start (untimed)."
                   + (f" Before every warm run, {args.flush_cpu_caches} MiB were written and read "
                      "by another process to push the previous run's data out of the CPU caches."
                      if args.flush_cpu_caches else "")),
    })
    try:
        import safetensors
        import transformers
        b.result["versions"] = {"safetensors": safetensors.__version__,
                                "transformers": transformers.__version__}
    except Exception as e:  # noqa: BLE001
        b.result["versions"] = {"error": repr(e)}
    log(f"bench_load: mode {b.result['mode']}, {b.result['machine']['nproc']} cores, "
        f"{b.result['machine']['mem_total']}, GPU {b.result['machine']['gpu'] or 'none'}; "
        f"outdir {b.outdir}")

    # ---- checkpoint and conversion ------------------------------------------------------------
    src = workdir / f"ckpt-{args.size_gb:g}gb"
    ck = make_checkpoint(src, args.size_gb, kv_heads=KV_HEADS, file_gb=max(0.25, args.size_gb / 4), log=log)
    b.result["checkpoint"] = {"dir": str(src), **ck}
    out = workdir / f"out-{args.size_gb:g}gb"
    want = {x.strip() for x in args.cases.split(",") if x.strip()}
    if not want or want - {"rank", "whole"}:
        raise SystemExit(f"bench_load: --cases {args.cases!r}: expected rank, whole or both (comma separated)")
    if args.world_size == 1 and "whole" not in want:
        raise SystemExit("bench_load: --world-size 1 has only the whole case; add it to --cases")
    sizes = ({args.world_size} if "rank" in want else set()) | ({1} if "whole" in want else set())
    if args.view_ws and "rank" in want:  # the other layout the rank case is also read from
        sizes.add(args.view_ws)
    b.result["convert"] = convert(str(reshard), src, out, sorted(sizes, reverse=True), ck, log,
                                  chunk_size=args.chunk_size)
    out_chunked = None
    if args.view_chunk_size and args.view_ws and "rank" in want:
        out_chunked = workdir / f"out-{args.size_gb:g}gb-c{args.view_chunk_size}"
        b.result["convert"]["view_chunked"] = convert(str(reshard), src, out_chunked, [args.view_ws], ck, log,
                                                      chunk_size=args.view_chunk_size)
    alt_rank_file = None
    if args.alt_chunk_size and "rank" in want and args.world_size > 1:
        out_alt = workdir / f"out-{args.size_gb:g}gb-rc{args.alt_chunk_size}"
        b.result["convert"]["rank_alt_chunk"] = convert(str(reshard), src, out_alt, [args.world_size], ck, log,
                                                        chunk_size=args.alt_chunk_size,
                                                        ranks=f"{args.rank}-{args.rank}")
        alt_rank_file = str(rank_file(out_alt, args.world_size, args.rank))
    file_2d = None
    if args.mesh and "rank" in want:
        file_2d, b.result["convert"]["dtensor"] = convert_dtensor(str(reshard), src, out, args.mesh, args.rank,
                                                                   workdir, log, args.chunk_size)
    src_files = sorted(str(p) for p in src.glob("*.safetensors"))
    cases = {
        "rank": {"title": f"rank {args.rank} of world size {args.world_size}",
                 "rank_file": str(rank_file(out, args.world_size, args.rank)),
                 "ws": args.world_size, "rank": args.rank},
        "whole": {"title": "whole model (world size 1)", "rank_file": str(rank_file(out, 1, 0)),
                  "ws": 1, "rank": 0},
    }
    if args.world_size == 1 or "rank" not in want:
        del cases["rank"]
    if "whole" not in want:  # e.g. a many-GB model measured on its rank files only
        del cases["whole"]
    for c in cases.values():
        c["file_bytes"] = os.path.getsize(c["rank_file"])
        try:
            hdr = json.loads(_C._testing.read_header(c["rank_file"]))
        except Exception as e:  # noqa: BLE001
            raise SystemExit(
                f"bench_load: reshard._C cannot read {c['rank_file']}: {e}\n(Do {reshard} and "
                "python/reshard/_C*.so come from the same build? Rebuild both, e.g. scripts/setup.sh, "
                f"or delete {out} if it was written by an older reshard.)")
        c["tensor_bytes"] = sum(e["nbytes"] for e in hdr["tensors"])
        c["tensors"] = len(hdr["tensors"])
    b.result["cases"] = cases
    # The file ranges the rank's loads without its rank file read (whole chunks of another
    # layout), for the ceiling of the same reads (series ceil-ranges-*).
    range_lists = {}
    if "rank" in cases:
        c = cases["rank"]
        views = {"hf": lambda: _C.SourceRankView.of_checkpoint(str(src), c["ws"], c["rank"])}
        if args.view_ws:
            views[f"ws{args.view_ws}"] = lambda: _C.SourceRankView.of_layout(str(out), f"fsdp2-ws{args.view_ws}",
                                                                            c["ws"], c["rank"])
            if out_chunked:
                views[f"ws{args.view_ws}c"] = lambda: _C.SourceRankView.of_layout(
                    str(out_chunked), f"fsdp2-ws{args.view_ws}", c["ws"], c["rank"])
        for tag, make in views.items():
            ranges = make().read_ranges()
            path = workdir / f"ranges-{args.size_gb:g}gb-{tag}-rank{c['rank']}-of{c['ws']}.txt"
            path.write_text("".join(f"{off} {n} {p}\n" for p, off, n in ranges))
            range_lists[tag] = str(path)
            b.result.setdefault("read_ranges", {})[tag] = {"ranges": len(ranges), "bytes": sum(r[2] for r in ranges)}
    log("cases: " + "; ".join(f"{k}: {c['tensor_bytes'] / 1e9:.3f} GB in {c['tensors']} tensors"
                              for k, c in cases.items()))
    b.save_json()

    # ---- series ---------------------------------------------------------------------------------
    dev_name = "cuda" if gpu else "cpu"
    top = max(threads)
    series = []  # dicts: id, case, label, group, modes, runner ("child"|"tool"), spec/argv

    def child(case, label, kind, modes, **kw):
        c = cases[case]
        spec = {"kind": kind, "device": dev_name, "cuda_device": args.device, "src": str(src),
                "ws": c["ws"], "rank": c["rank"], "rank_file": c["rank_file"], "check": "sample",
                **kw}
        series.append({"id": f"{case}/{label}", "case": case, "label": label, "group": "loader",
                       "modes": modes, "runner": "child", "spec": spec})

    def tool(case, label, modes, argv, group="ceiling"):
        series.append({"id": f"{case}/{label}", "case": case, "label": label, "group": group,
                       "modes": modes, "runner": "tool", "argv": argv})

    for case, c in cases.items():
        f = c["rank_file"]
        if have_tool:
            tool(case, "ceil-seq-read", ["cold"], ["read", "--file", f, "--threads", "1", "--request", "16MiB"])
            tool(case, "ceil-seq-direct", ["cold"], ["read", "--file", f, "--threads", "1", "--request", "16MiB", "--direct"])
            if case == "rank":  # the same reads as the loads without the rank file, nothing else
                for tag, lst in range_lists.items():
                    tool(case, f"ceil-ranges-{tag}", ["cold"],
                         ["ranges", "--list", lst, "--threads", str(top), "--request", "4MiB", "--direct"])
            if gpu:
                tool(case, "ceil-pipeline", ["cold", "warm"], None)  # argv per mode below
                tool(case, "ceil-read-pinned", ["warm"], ["read", "--file", f, "--threads", "16", "--request", "2MiB", "--pinned"])
            else:
                tool(case, "ceil-read-16t", ["warm"], ["read", "--file", f, "--threads", "16", "--request", "2MiB"])
        for t in threads:
            child(case, f"reshard-t{t}", "reshard", ["cold", "warm"], threads=t, verify=True, io="auto",
                  second_load=True)
        child(case, f"reshard-t{top}-noverify", "reshard", ["warm"], threads=top, verify=False, io="auto")
        if gpu:  # the flow of a job: reshard.prepare (empty_model) before the model is allocated
            child(case, f"reshard-t{top}-prepared", "reshard", ["cold", "warm"], threads=top,
                  verify=True, io="auto", prepare=True, second_load=True)
            # Diagnostics of the first load (run only when --only names them): without the
            # copy engine's warm-up in prepare; with every core kept busy for 30 ms just before
            # the timer (do idle cores slow a first load?).
            child(case, f"reshard-t{top}-prepared-nowarm", "reshard", ["warm"], threads=top,
                  verify=True, io="auto", prepare=True, second_load=True, diagnostic=True,
                  env={"RESHARD_WARMUP": "0"})
            # The same with knobs from the environment: one series per --diag-env, named
            # -env, -env2, -env3, ...
            for n, group in enumerate(args.diag_env, start=1):
                knobs = dict(kv.split("=", 1) for kv in group.split(",") if kv)
                child(case, f"reshard-t{top}-prepared-env{n if n > 1 else ''}", "reshard", ["warm"],
                      threads=top, verify=True, io="auto", prepare=True, second_load=True,
                      diagnostic=True, env=knobs)
            # Another rank file loaded first, untimed (rank 1 of the same world size; for
            # the whole model, the rank file).
            other = (str(rank_file(out, args.world_size, (args.rank + 1) % args.world_size))
                     if case == "rank" else cases.get("rank", {}).get("rank_file"))
            if other:
                child(case, f"reshard-t{top}-prepared-otherfile", "reshard", ["warm"], threads=top,
                      verify=True, io="auto", prepare=True, second_load=True, diagnostic=True,
                      preload_file=other)
            child(case, f"reshard-t{top}-prepared-zeroed", "reshard", ["warm"], threads=top,
                  verify=True, io="auto", prepare=True, second_load=True, diagnostic=True,
                  zero_targets=True)
            child(case, f"reshard-t{top}-prepared-noprobe", "reshard", ["warm"], threads=top,
                  verify=True, io="auto", prepare=True, second_load=True, diagnostic=True,
                  no_probe=True)
            # Six loads in one process: does a fresh process's first load differ from the
            # loads after it, and for how many?
            child(case, f"reshard-t{top}-prepared-6loads", "reshard", ["warm"], threads=top,
                  verify=True, io="auto", prepare=True, second_load=True, more_loads=5,
                  diagnostic=True)
            if have_tool:
                # 1 GiB in all written and read by one thread per core (another process)
                # just before each load, the first and the later ones alike: is a first load
                # slower because of what the CPU caches hold?
                flush = [str(ceilings), "flush", "--mib", "1024", "--threads",
                         str(os.cpu_count() or 1)]
                child(case, f"reshard-t{top}-prepared-flushed", "reshard", ["warm"], threads=top,
                      verify=True, io="auto", prepare=True, second_load=True, more_loads=2,
                      diagnostic=True, pre_argv=flush, between_argv=flush)
                child(case, f"reshard-t{top}-prepared-spin", "reshard", ["warm"], threads=top,
                      verify=True, io="auto", prepare=True, second_load=True, diagnostic=True,
                      pre_argv=[str(ceilings), "spin", "--ms", "30", "--threads",
                                str(os.cpu_count() or 1)])
        if case == "rank" and alt_rank_file:  # the same rank file at --alt-chunk-size
            child(case, f"reshard-rc-t{top}-prepared", "reshard", ["cold", "warm"], threads=top,
                  verify=True, io="auto", prepare=gpu, second_load=True, rank_file=alt_rank_file)
        if case == "rank":
            # Without the rank file of this world size: straight from the Hugging Face files,
            # and from another world size's layout (issue 23).
            child(case, f"reshard-hf-t{top}-prepared", "view", ["cold", "warm"], threads=top,
                  prepare=gpu, second_load=True, view="checkpoint")
            for n, group in enumerate(args.diag_env, start=1):  # diagnostics: with the knobs of --diag-env
                knobs = dict(kv.split("=", 1) for kv in group.split(",") if kv)
                # Two of them are the call's, not the environment's: io=auto|direct|readahead|buffered
                # (the view's load(io=)) and threads=N (its readers, and the prepared pool's lanes).
                io = knobs.pop("io", "auto")
                t = int(knobs.pop("threads", top))
                child(case, f"reshard-hf-t{top}-prepared-env{n if n > 1 else ''}", "view", ["cold", "warm"],
                      threads=t, prepare=gpu, second_load=True, view="checkpoint", diagnostic=True, env=knobs,
                      io=io)
            if out_chunked:
                child(case, f"reshard-ws{args.view_ws}c-t{top}-prepared", "view", ["cold", "warm"],
                      threads=top, prepare=gpu, second_load=True, view=f"fsdp2-ws{args.view_ws}",
                      out=str(out_chunked))
            if args.view_ws:
                child(case, f"reshard-ws{args.view_ws}-t{top}-prepared", "view", ["cold", "warm"],
                      threads=top, prepare=gpu, second_load=True, view=f"fsdp2-ws{args.view_ws}",
                      out=str(out))
                # Diagnostics (only when --only names them): the same view without checksums,
                # and with the knobs of each --diag-env (-env, -env2, ...).
                child(case, f"reshard-ws{args.view_ws}-t{top}-prepared-noverify", "view", ["warm"],
                      threads=top, prepare=gpu, second_load=True, view=f"fsdp2-ws{args.view_ws}",
                      out=str(out), verify=False, diagnostic=True)
                for n, group in enumerate(args.diag_env, start=1):
                    knobs = dict(kv.split("=", 1) for kv in group.split(",") if kv)
                    child(case, f"reshard-ws{args.view_ws}-t{top}-prepared-env{n if n > 1 else ''}", "view",
                          ["cold", "warm"], threads=top, prepare=gpu, second_load=True,
                          view=f"fsdp2-ws{args.view_ws}", out=str(out), diagnostic=True, env=knobs)
            if file_2d:
                # A DTensor layout's rank file (issue 22): the same loader, each entry the rank's
                # local tensor of its placements; checked against the source by the element map.
                child(case, f"reshard-2d-t{top}-prepared", "reshard", ["cold", "warm"], threads=top,
                      verify=True, io="auto", prepare=gpu, second_load=True, rank_file=file_2d,
                      dtensor=True)
            child(case, "safe_open-slices", "slices", ["cold", "warm"])
        else:
            child(case, "load_file", "load_file", ["cold", "warm"])
        child(case, "dcp-fsdp2", "dcp", ["cold", "warm"], dcp_threads=args.dcp_threads)
    for s in series:
        if s["label"] == "ceil-pipeline":
            f = cases[s["case"]]["rank_file"]
            s["argv_by_mode"] = {
                "cold": ["pipeline", "--file", f, "--threads", "16", "--request", "16MiB"],
                "warm": ["pipeline", "--file", f, "--threads", "16", "--request", "2MiB"]}
    keep = {x.strip() for x in (args.only or "").split(",") if x.strip()}
    series = [s for s in series if (s["label"] in keep or s["id"] in keep) or
              (not keep and not s.get("spec", {}).get("diagnostic"))]
    if args.no_cold:
        for s in series:
            s["modes"] = [m for m in s["modes"] if m != "cold"]
    if args.no_warm:
        for s in series:
            s["modes"] = [m for m in s["modes"] if m != "warm"]
    for s in series:
        if s["runner"] == "tool" and s["argv"] is not None and "argv_by_mode" not in s:
            s["argv_by_mode"] = {m: s["argv"] for m in s["modes"]}
        if s["runner"] == "tool":
            s["argv_by_mode"] = {m: [str(ceilings), *a, "--device", str(args.device)]
                                 for m, a in s["argv_by_mode"].items()}

    me = [sys.executable, str(Path(__file__).resolve()), "_child"]

    def run_once(s, mode, rep, discard=False, extra_spec=None):
        rec = {"series": s["id"], "case": s["case"], "label": s["label"], "group": s["group"],
               "mode": mode, "rep": rep, "discard": discard}
        if mode == "warm" and args.flush_cpu_caches and have_tool:
            f = run_child([str(ceilings), "flush", "--mib", str(args.flush_cpu_caches), "--threads",
                           str(os.cpu_count() or 1)], env=env, timeout=120)
            if f["rc"] != 0:
                raise SystemExit("bench_load: flush failed: " + (f["stderr"] or f["stdout"])[-500:])
        if s["runner"] == "tool":
            if mode == "cold":
                why = drop_caches()
                if why:
                    raise SystemExit("bench_load: " + why)
            r = run_child(s["argv_by_mode"][mode], env=env, timeout=300)
            res = None
            if r["rc"] == 0:
                try:
                    res = json.loads(r["stdout"].strip().splitlines()[-1])
                except (json.JSONDecodeError, IndexError):
                    res = None
            if res is None:
                res = {"ok": False, "error": (r["stderr"].strip() or r["stdout"].strip())[-1500:]
                       or f"exit {r['rc']}"}
            else:
                res["tool_mode"] = res.pop("mode", None)
                res["ok"] = True
                if res["tool_mode"] == "ranges":  # GB/s of the bytes a load lands, as the loads' are
                    res["listed_bytes"] = res["bytes"]
                    res["bytes"] = cases[s["case"]]["tensor_bytes"]
                    res["gbps"] = res["bytes"] / res["seconds"] / 1e9 if res["seconds"] > 0 else 0.0
        else:
            spec = dict(s["spec"], cold=(mode == "cold"), **(extra_spec or {}))
            if mode != "warm" or discard:
                spec.pop("second_load", None)
            r = run_child([*me, json.dumps(spec)], env=env, timeout=600)
            res = parse_result(r["stdout"])
            if res is None:
                tail = (r["stderr"] + r["stdout"]).strip()[-1500:]
                res = {"ok": False, "error": ("timed out; " if r["timed_out"] else "") +
                       f"child exit {r['rc']} without a result: {tail}"}
            rec["rss_wait4_maxrss_kib"] = r["maxrss_kib"]
        rec["wall_seconds"] = round(r["wall"], 3)
        rec.update(res)
        files = rec.pop("runtime_files", None)
        if not rec.get("ok"):
            b.errors.setdefault(f"{s['id']}/{mode}", rec.get("error", "failed"))
            b.log(f"  FAILED {s['id']} {mode}: {rec.get('error', '')[:800]}")
            if rec.get("traceback"):
                b.log(rec["traceback"], quiet=True)
        b.runs.append(rec)
        b.save_json()
        return rec, files

    def timed(s, mode, rep):
        """One timed run; a warm run that finds its files evicted (another process dropped the
        page cache, or memory pressure) is discarded and run again once after re-reading."""
        rec, _ = run_once(s, mode, rep)
        cached = rec.get("resident_fraction_before")
        if mode == "warm" and rec.get("ok") and cached is not None and cached < 0.9:
            rec["discard"] = True
            rec["discard_reason"] = f"page cache not warm ({cached:.2f} of the file cached)"
            log(f"  warm {s['id']:28s} {describe(rec)}  [discarded: not warm; re-reading, again]")
            read_files(warm_files)
            rec, _ = run_once(s, mode, rep)
        elif mode == "cold" and rec.get("ok") and cached is not None and cached > 0.05:
            rec["warning"] = f"cold run found {cached:.2f} of its file cached"
        return rec

    def describe(rec):
        if not rec.get("ok"):
            return "FAILED"
        sx = f"{rec['gbps']:7.2f} GB/s  {rec['seconds']:7.3f} s"
        if rec.get("rss_peak_load_kib"):
            sx += f"  rss {rec['rss_peak_load_kib'] / 1024:6.0f} MiB"
        if rec.get("resident_fraction_before") is not None:
            sx += f"  cached {rec['resident_fraction_before']:.2f}"
        sx += f"  (wall {rec['wall_seconds']:.1f} s)"
        return sx

    # ---- warm-up pass: every warm series once, discarded -----------------------------------------
    # It is the "first timed run, discarded" of the warm method, checks that every path works
    # before the timed passes (a series that fails here is not timed), reports the files the
    # children map (for RuntimeKeeper), and, for reshard at the top thread count, compares every
    # tensor with safe_open slices of the source (the correctness check).
    warm_files = src_files + [c["rank_file"] for c in cases.values()]
    warm_files += sorted({s["spec"]["rank_file"] for s in series if s["runner"] == "child"} - set(warm_files))
    warm_files += sorted({s["spec"]["preload_file"] for s in series
                          if s["runner"] == "child" and s["spec"].get("preload_file")})
    # A view of another layout reads that layout's rank files: warm runs need them cached too
    # (after a cold pass dropped the page cache, they were read cold inside "warm" runs).
    warm_files += sorted({str(f) for s in series
                          if s["runner"] == "child" and s["spec"].get("view") not in (None, "checkpoint")
                          for f in (Path(s["spec"]["out"]) / s["spec"]["view"]).glob("*.reshard")})
    if any("warm" in s["modes"] for s in series):
        t = read_files(warm_files)
        log(f"warm-up: files read once ({t:.1f} s); one discarded run of each warm series")
    else:  # --no-warm: each cold run is still checked against safe_open slices ("sample")
        b.notes.append("no warm series: the full correctness check (every tensor of reshard-tN vs "
                       "safe_open slices) did not run; each cold run checked a sample")
    keeper = None if args.no_keep_runtime else RuntimeKeeper([workdir, b.outdir])
    b.result["correctness"] = {}
    for s in series:
        if "warm" not in s["modes"]:
            continue
        extra = {"probe": True}
        full_check = s["runner"] == "child" and s["label"] == f"reshard-t{top}"
        if full_check:
            extra["check"] = "all"
        rec, files = run_once(s, "warm", -1, discard=True, extra_spec=extra)
        log(f"  warm {s['id']:28s} {describe(rec)}  [discarded]")
        if files and keeper is not None:
            keeper.add(files)
        if full_check:
            chk = rec.get("check", {})
            ok = bool(rec.get("ok")) and chk.get("ok", False)
            b.result["correctness"][s["case"]] = {
                "rank_file": cases[s["case"]]["rank_file"], "ok": ok,
                "tensors_checked": chk.get("checked"), "bytes_checked": chk.get("checked_bytes"),
                "problems": chk.get("problems") or rec.get("error")}
            log(f"  correctness: every tensor of {os.path.basename(cases[s['case']]['rank_file'])} "
                f"vs safe_open slices: {'OK' if ok else 'FAILED'} ({chk.get('checked')} tensors, "
                f"{(chk.get('checked_bytes') or 0) / 1e9:.3f} GB)")
        if not rec.get("ok"):
            s["modes"] = []
            b.notes.append(f"{s['id']}: not timed, its warm-up run failed: {rec.get('error', '')[:300]}")
    if keeper is not None:
        b.result["runtime_keeper"] = {"files": len(keeper.maps), "bytes": keeper.bytes}
        log(f"keeper: {len(keeper.maps)} runtime files ({keeper.bytes / 1e9:.2f} GB) kept mapped "
            "across page-cache drops")

    # ---- timed passes: per repetition a cold pass then a warm pass ------------------------------
    cold_series = [s for s in series if "cold" in s["modes"]]
    warm_series = [s for s in series if "warm" in s["modes"]]
    if cold_series:
        why = drop_caches()
        if why:
            b.notes.append("cold runs skipped: " + why)
            log("cold runs skipped: " + why)
            cold_series = []
    rep_seconds = None
    for rep in range(args.reps):
        tail = 15 if gpu else 2  # H2D runs and the summary after the last repetition
        if rep > 0 and args.budget_s and b.elapsed() + 1.05 * rep_seconds + tail > args.budget_s:
            b.notes.append(f"time budget {args.budget_s:.0f} s: stopped after {rep} repetition(s) "
                           f"(one takes ~{rep_seconds:.0f} s)")
            log(b.notes[-1])
            break
        t_rep = time.perf_counter()
        if cold_series:
            log(f"cold: repetition {rep + 1}/{args.reps} (page cache dropped before each run)")
            # The order rotates by repetition: the disk drifts within a call and a fixed order
            # gave one series the same slot every time (run AF, BENCHMARKS §5: ±5 % by slot).
            k = rep % len(cold_series)
            for s in cold_series[k:] + cold_series[:k]:
                rec = timed(s, "cold", rep)
                log(f"  cold {s['id']:28s} {describe(rec)}")
        if warm_series:
            if cold_series:
                t = read_files(warm_files)
                log(f"warm: files read again after the cold pass ({t:.1f} s)")
            log(f"warm: repetition {rep + 1}/{args.reps}")
            for s in warm_series:
                rec = timed(s, "warm", rep)
                log(f"  warm {s['id']:28s} {describe(rec)}")
        rep_seconds = time.perf_counter() - t_rep

    # ---- pinned H2D ---------------------------------------------------------------------------
    h2d = []
    if gpu and have_tool and (not args.only or "ceil-h2d" in args.only):
        # 2 GiB whatever the cases (what every run before --cases measured): the ceiling does
        # not move with the files measured.
        nbytes_h2d = 2 << 30
        for t, req in ((16, "2MiB"), (4, "64MiB"), (1, "256MiB")):
            s = {"id": f"h2d/t{t}-{req}", "case": "all", "label": f"ceil-h2d-t{t}-{req}",
                 "group": "ceiling", "runner": "tool", "argv_by_mode": {"warm": [
                     str(ceilings), "h2d", "--bytes", str(nbytes_h2d), "--reps", "5", "--threads",
                     str(t), "--request", req, "--device", str(args.device)]}}
            rec, _ = run_once(s, "warm", 0)
            log(f"  h2d  threads {t:2d} request {req:7s} {describe(rec)}")
            if rec.get("ok"):
                h2d.append(rec)

    # ---- summary --------------------------------------------------------------------------------
    summary = build_summary(b, cases, series, h2d, threads, gpu)
    b.result["summary"] = summary
    text = render_table(b, cases, summary)
    try:  # where the loads' time went (bench/load_phases.py)
        from load_phases import phases_table
        text += "\n\n" + phases_table(b.result | {"runs": b.runs})
    except Exception as e:  # noqa: BLE001  (the table above stands without it)
        text += f"\n\n(no phase table: {type(e).__name__}: {e})"
    print(text, flush=True)
    b.txt_path.write_text(text + "\n")
    b.save_json()
    try:
        make_chart(b, cases, summary)
        log(f"chart: {b.png_path}")
    except Exception as e:  # noqa: BLE001  (matplotlib missing or failing: JSON and text still written)
        b.notes.append(f"no chart: {type(e).__name__}: {e}")
        log(b.notes[-1])
    log(f"done in {b.elapsed():.0f} s: {b.json_path}, {b.txt_path}, {b.log_path}")
    failed = [k for k in b.errors]
    if any(not v["ok"] for v in b.result.get("correctness", {}).values()):
        return 3
    return 1 if failed else 0


def build_summary(b, cases, series, h2d, threads, gpu):
    summ = {"cases": {}}
    for case in cases:
        rows = {}
        for s in series:
            if s["case"] != case:
                continue
            row = {"label": s["label"], "group": s["group"]}
            for mode in ("cold", "warm"):
                runs = [r for r in b.runs if r["series"] == s["id"] and r["mode"] == mode
                        and not r.get("discard") and r.get("ok")]
                if not runs:
                    continue
                g = summarize([r["gbps"] for r in runs])
                g["seconds_median"] = statistics.median(r["seconds"] for r in runs)
                w4 = [r["rss_wait4_maxrss_kib"] for r in runs if r.get("rss_wait4_maxrss_kib")]
                if w4:
                    g["rss_wait4_mib"] = max(w4) / 1024
                rss = [r["rss_peak_load_kib"] for r in runs if r.get("rss_peak_load_kib")]
                if rss:
                    g["rss_peak_mib"] = max(rss) / 1024
                    g["rss_growth_mib"] = max(r["rss_peak_load_kib"] - r.get("rss_before_kib", 0)
                                              for r in runs if r.get("rss_peak_load_kib")) / 1024
                gx = [r["gpu"] for r in runs if r.get("gpu")]
                if gx:
                    g["gpu_extra_allocated_mib"] = max(x["extra_allocated_peak"] for x in gx) / 2**20
                    g["gpu_transient_mib"] = max(x.get("transient_peak", 0) for x in gx) / 2**20
                    g["gpu_extra_reserved_mib"] = max(x["extra_reserved_peak"] for x in gx) / 2**20
                    g["gpu_extra_meminfo_mib"] = max(x["extra_meminfo_after"] for x in gx) / 2**20
                pins = [r.get("pinned_bytes") or r.get("host_buffer_bytes") or 0 for r in runs]
                if any(pins):
                    g["pinned_mib"] = max(pins) / 2**20
                sec2 = [r["second_load_seconds"] for r in runs if r.get("second_load_seconds")]
                if sec2:
                    g["second_load_gbps_median"] = runs[0]["bytes"] / statistics.median(sec2) / 1e9
                g["checks_ok"] = all(r.get("check", {}).get("ok", True) for r in runs)
                g["cached_before"] = statistics.median(r.get("resident_fraction_before", 0) or 0
                                                       for r in runs)
                row[mode] = g
            rows[s["label"]] = row
        summ["cases"][case] = rows
    if h2d:
        summ["h2d"] = {r["label"]: {"gbps_median": r["gbps"], "gbps_max": r.get("gbps_max"),
                                    "threads": r.get("threads"), "request": r.get("request")}
                       for r in h2d}
        summ["h2d_best_gbps"] = max(r["gbps"] for r in h2d)

    def med(case, label, mode):
        return summ["cases"].get(case, {}).get(label, {}).get(mode, {}).get("median")

    ratios = {}
    for case in cases:
        rows = summ["cases"][case]
        best = {}
        for mode in ("cold", "warm"):
            cands = [(med(case, f"reshard-t{t}", mode), f"reshard-t{t}") for t in threads]
            cands = [c for c in cands if c[0]]
            if cands:
                best[mode] = max(cands)
        r = {"reshard_cold_config": best.get("cold", (None, None))[1],
             "reshard_warm_config": best.get("warm", (None, None))[1]}

        def ratio(num, den):
            return round(num / den, 3) if num and den else None

        rc = best.get("cold", (None,))[0]
        rw = best.get("warm", (None,))[0]
        r["cold_vs_seq_read_ceiling"] = ratio(rc, med(case, "ceil-seq-read", "cold"))
        r["cold_vs_seq_direct_ceiling"] = ratio(rc, med(case, "ceil-seq-direct", "cold"))
        r["cold_vs_pipeline_cold"] = ratio(rc, med(case, "ceil-pipeline", "cold"))
        warm_ceils = [x for x in (med(case, "ceil-read-pinned", "warm"), med(case, "ceil-read-16t", "warm"),
                                  summ.get("h2d_best_gbps")) if x]
        r["warm_ceiling_gbps"] = round(min(warm_ceils), 3) if warm_ceils else None
        r["warm_vs_min_warm_ceilings"] = ratio(rw, r["warm_ceiling_gbps"])
        r["warm_vs_pipeline_warm"] = ratio(rw, med(case, "ceil-pipeline", "warm"))
        if case == "rank":
            r["cold_vs_safe_open_slices"] = ratio(rc, med(case, "safe_open-slices", "cold"))
            r["warm_vs_safe_open_slices"] = ratio(rw, med(case, "safe_open-slices", "warm"))
        else:
            r["cold_vs_load_file"] = ratio(rc, med(case, "load_file", "cold"))
            r["warm_vs_load_file"] = ratio(rw, med(case, "load_file", "warm"))
        r["cold_vs_dcp"] = ratio(rc, med(case, "dcp-fsdp2", "cold"))
        r["warm_vs_dcp"] = ratio(rw, med(case, "dcp-fsdp2", "warm"))
        top = max(threads)
        r["warm_prepared_vs_dcp"] = ratio(med(case, f"reshard-t{top}-prepared", "warm"),
                                          med(case, "dcp-fsdp2", "warm"))
        for mode in ("cold", "warm"):
            r[f"{mode}_prepared_vs_unprepared"] = ratio(med(case, f"reshard-t{top}-prepared", mode),
                                                        med(case, f"reshard-t{top}", mode))
        warm_ceil = r["warm_ceiling_gbps"]
        r["warm_prepared_vs_min_warm_ceilings"] = ratio(med(case, f"reshard-t{top}-prepared", "warm"), warm_ceil)
        r["warm_prepared_vs_pipeline_warm"] = ratio(med(case, f"reshard-t{top}-prepared", "warm"),
                                                    med(case, "ceil-pipeline", "warm"))
        r["cold_prepared_vs_seq_read_ceiling"] = ratio(med(case, f"reshard-t{top}-prepared", "cold"),
                                                       med(case, "ceil-seq-read", "cold"))
        for mode in ("cold", "warm"):
            r[f"{mode}_2d_vs_rank_file"] = ratio(med(case, f"reshard-2d-t{top}-prepared", mode),
                                                 med(case, f"reshard-t{top}-prepared", mode))
        r["warm_verify_vs_noverify"] = ratio(med(case, f"reshard-t{top}", "warm"),
                                        med(case, f"reshard-t{top}-noverify", "warm"))
        ratios[case] = r
    summ["ratios"] = ratios
    return summ


def render_table(b, cases, summ) -> str:
    def fmt(g):
        if not g:
            return "-"
        if g["n"] > 1:
            return f"{g['median']:6.2f} [{g['min']:.2f}-{g['max']:.2f}]"
        return f"{g['median']:6.2f}"

    lines = []
    for case, c in cases.items():
        lines.append("")
        lines.append(f"== {c['title']}: {c['tensor_bytes'] / 1e9:.3f} GB, {c['tensors']} tensors "
                     f"({os.path.basename(c['rank_file'])}) ==")
        lines.append(f"{'path':26s} {'cold GB/s [min-max]':>22s} {'warm GB/s [min-max]':>22s} "
                     f"{'rss MiB':>8s} {'rss+ MiB':>8s} {'gpu+ MiB':>9s} {'gpu tmp':>8s} {'pinned MiB':>10s} {'2nd load':>8s} {'check':>6s}")
        for label, row in summ["cases"][case].items():
            if not (row.get("cold") or row.get("warm")):
                continue
            g = row.get("warm") or row.get("cold") or {}
            rss = max([row.get(m, {}).get("rss_peak_mib", 0) or 0 for m in ("cold", "warm")])
            grow = max([row.get(m, {}).get("rss_growth_mib", 0) or 0 for m in ("cold", "warm")])
            gpux = max([row.get(m, {}).get("gpu_extra_allocated_mib", -1e18) for m in ("cold", "warm")])
            gtmp = max([row.get(m, {}).get("gpu_transient_mib", -1e18) for m in ("cold", "warm")])
            pin = g.get("pinned_mib")
            sec = (row.get("warm") or {}).get("second_load_gbps_median")
            chk = [row.get(m, {}).get("checks_ok") for m in ("cold", "warm") if m in row]
            lines.append(
                f"{label:26s} {fmt(row.get('cold')):>22s} {fmt(row.get('warm')):>22s} "
                f"{(f'{rss:8.0f}' if rss else '-'):>8s} {(f'{grow:8.0f}' if rss else '-'):>8s} "
                f"{(f'{gpux:9.1f}' if gpux > -1e17 else '-'):>9s} "
                f"{(f'{gtmp:8.1f}' if gtmp > -1e17 else '-'):>8s} "
                f"{(f'{pin:10.0f}' if pin else '-'):>10s} {(f'{sec:8.2f}' if sec else '-'):>8s} "
                f"{('ok' if all(chk) else 'FAIL') if chk else '-':>6s}")
        r = summ["ratios"][case]
        lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in r.items() if v is not None))
    if summ.get("h2d"):
        lines.append("")
        lines.append("pinned H2D: " + ", ".join(f"{k} {v['gbps_median']:.1f} GB/s" for k, v in summ["h2d"].items()))
    for case, corr in (b.result.get("correctness") or {}).items():
        lines.append(f"correctness ({case}: every tensor of reshard's load vs safe_open slices of "
                     f"the source): {'OK' if corr['ok'] else 'FAILED ' + str(corr['problems'])} "
                     f"({corr.get('tensors_checked')} tensors, {(corr.get('bytes_checked') or 0) / 1e9:.3f} GB)")
    if b.errors:
        lines.append("errors: " + "; ".join(f"{k}: {v[:200]}" for k, v in b.errors.items()))
    for n in b.notes:
        lines.append("note: " + n)
    lines.append("(GB = 1e9 bytes landed; rss = the child's peak RSS through the load (VmHWM), rss+ = "
                 "its growth during the timed load; gpu+ = peak torch allocation beyond the weights (the "
                 "caching allocator's rounding of the weights' own blocks included); gpu tmp = peak torch "
                 "allocation during the timed load beyond what it started and ended with; "
                 "pinned = pinned host bytes (reshard staging, ceiling buffers); 2nd load = GB/s of a "
                 "second warm load in the same process (no one-time set-up); [min-max] over reps)")
    return "\n".join(lines)


def make_chart(b, cases, summ):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(8 * len(cases), 6.5), squeeze=False)
    for ax, (case, c) in zip(axes[0], cases.items()):
        rows = summ["cases"][case]
        labels = [l for l, r in rows.items() if r["group"] == "loader" and (r.get("cold") or r.get("warm"))]
        x = list(range(len(labels)))
        w = 0.38
        for i, (mode, color) in enumerate((("cold", "#4a7ab5"), ("warm", "#e08a2c"))):
            vals, lo, hi = [], [], []
            for l in labels:
                g = rows[l].get(mode)
                vals.append(g["median"] if g else 0)
                lo.append(g["median"] - g["min"] if g else 0)
                hi.append(g["max"] - g["median"] if g else 0)
            xs = [xx + (i - 0.5) * w for xx in x]
            bars = ax.bar(xs, vals, w, yerr=[lo, hi], capsize=3, color=color, label=mode)
            for bar, v in zip(bars, vals):
                if v:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v),
                                ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                                textcoords="offset points")
        refs = [("ceil-seq-read", "cold", "#4a7ab5", "--", "seq read (cold)"),
                ("ceil-pipeline", "cold", "#4a7ab5", ":", "C++ loop (cold)"),
                ("ceil-read-pinned", "warm", "#e08a2c", "--", "page cache→pinned 16t (warm)"),
                ("ceil-read-16t", "warm", "#e08a2c", "--", "page cache→host 16t (warm)"),
                ("ceil-pipeline", "warm", "#e08a2c", ":", "C++ loop (warm)")]
        for label, mode, color, ls, text in refs:
            g = rows.get(label, {}).get(mode)
            if g:
                ax.axhline(g["median"], color=color, ls=ls, lw=1.2,
                           label=f"{text}: {g['median']:.1f} GB/s")
        if summ.get("h2d_best_gbps"):
            ax.axhline(summ["h2d_best_gbps"], color="gray", ls="-.", lw=1.2,
                       label=f"pinned H2D: {summ['h2d_best_gbps']:.1f} GB/s")
        ax.set_yscale("log")
        fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("GB/s (1e9 bytes landed / s), log scale")
        ax.set_title(f"{c['title']}: {c['tensor_bytes'] / 1e9:.2f} GB", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"reshard loader vs ceilings and peers ({b.result.get('machine', {}).get('gpu') or 'CPU only'}; "
                 f"{b.result.get('date_utc', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(b.png_path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
