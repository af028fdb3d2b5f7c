"""Checkpoint saves on one GPU: how long training is blocked, and when the checkpoint is
durable, for reshard.save (blocking and asynchronous, both snapshot kinds), DCP `save` and DCP
`async_save`, with the disk's write ceiling measured in the same run (issue 24).

The model: Llama-shaped bf16 parameters (default ~3.4 B: hidden 3072, intermediate 8192,
28 layers, vocabulary 32000) under FSDP2 at world size 1, with AdamW state (bf16 exp_avg and
exp_avg_sq after one step): ~20 GB per checkpoint. Each case starts after `sync` and dropping
the page cache, writes into an empty directory on the same disk, and its directory is removed
afterwards. The write ceiling is the best of three ways to write the same bytes in 64 MiB
writes: buffered then fsync, buffered with each range handed to the disk at once
(sync_file_range), and O_DIRECT. Times are what the caller sees: from the call to its return (stall), and from the
call to the checkpoint being durable (reshard: the handle's wait() returns with the manifest
written, files fsynced; DCP: the future's result, files synced by FileSystemWriter). Host
memory: the peak RSS above the case's start, sampled every 20 ms; GPU: the peak allocation
above the model and state.

    python3 bench/bench_save.py --dir /path/on/disk --outdir results/
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples this process's RSS every 20 ms while active."""

    def __enter__(self):
        self.base = rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def build(args, torch, nn):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    h, i, layers, vocab = args.hidden, args.intermediate, args.layers, args.vocab

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            for n in ("q", "k", "v", "o"):
                setattr(self, n, nn.Linear(h, h, bias=False))
            self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
            self.down = nn.Linear(i, h, bias=False)
            self.norm1, self.norm2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, h)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.Parameter(torch.ones(h))
            self.lm_head = nn.Linear(h, vocab, bias=False)

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Model()
    torch.set_default_dtype(torch.float32)
    mesh = init_device_mesh("cuda", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def state_bytes(model, opt, torch) -> int:
    n = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v = v.to_local() if hasattr(v, "to_local") else v
                n += v.numel() * v.element_size()
    return n


def ceiling_write(path: Path, nbytes: int, mode: str) -> float:
    """nbytes written with 64 MiB writes from one buffer, then fsync: seconds. mode "plain":
    buffered writes; "writeback": buffered, each write's range handed to the disk at once
    (sync_file_range SYNC_FILE_RANGE_WRITE); "direct": O_DIRECT from a page-aligned buffer."""
    import ctypes
    import mmap

    piece = 64 << 20
    buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * 64)
    view = memoryview(buf)
    libc = ctypes.CDLL(None, use_errno=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if mode == "direct" else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        off = 0
        while off < nbytes:
            n = os.write(fd, view[:piece])
            if mode == "writeback":
                libc.sync_file_range(fd, ctypes.c_int64(off), ctypes.c_int64(n), 2)  # SYNC_FILE_RANGE_WRITE
            off += n
        os.fsync(fd)
    finally:
        os.close(fd)
    view.release()
    buf.close()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="a directory on the disk to write to")
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--cases", default="ceiling,ceiling-writeback,ceiling-direct,reshard-blocking,"
                    "reshard-async-auto,reshard-async-host,reshard-async-host,dcp-save,dcp-async,"
                    "ceiling,ceiling-writeback,ceiling-direct")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import reshard

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    gloo = dist.new_group(backend="gloo")
    reshard.prepare(0, wait=True)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, opt = build(args, torch, nn)
    nbytes = state_bytes(model, opt, torch)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.2f} B parameters, checkpoint {nbytes / 1e9:.2f} GB "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
    results = {"date": common.utc_now(), "machine": common.machine_info(work), "noise": common.noise_snapshot(),
               "params": n_params, "checkpoint_bytes": nbytes, "cases": []}
    base_alloc = torch.cuda.memory_allocated()

    for i, case in enumerate(args.cases.split(",")):
        target = work / f"case-{i}"
        shutil.rmtree(target, ignore_errors=True)
        gc.collect()
        torch.cuda.synchronize()
        why = common.drop_caches()
        torch.cuda.reset_peak_memory_stats()
        row = {"case": case}
        with PeakRss() as mem:
            t_call = time.perf_counter()
            if case.startswith("ceiling"):
                target.mkdir()
                mode = case.split("-", 1)[1] if "-" in case else "plain"
                row["stall_s"] = row["durable_s"] = ceiling_write(target / "f", nbytes, mode)
            elif case == "reshard-blocking":
                r = reshard.save(model, str(target), optimizer=opt, step=1)
                row["stall_s"] = time.perf_counter() - t_call
                row["durable_s"] = row["stall_s"]
                row["written"] = r.bytes
            elif case.startswith("reshard-async"):
                h = reshard.save(model, str(target), optimizer=opt, step=1, blocking=False,
                                 snapshot=case.rsplit("-", 1)[1])
                row["stall_s"] = time.perf_counter() - t_call
                r = h.wait()
                row["durable_s"] = time.perf_counter() - t_call
                row["snapshot"] = r.snapshot
                row["written"] = r.bytes
            elif case == "dcp-save":
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(target))
                row["stall_s"] = row["durable_s"] = time.perf_counter() - t_call
            elif case == "dcp-async":
                msd, osd = get_state_dict(model, opt)
                fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(target),
                                     process_group=gloo)
                row["stall_s"] = time.perf_counter() - t_call
                fut.result()
                row["durable_s"] = time.perf_counter() - t_call
            else:
                raise SystemExit(f"unknown case {case}")
        row["host_peak_bytes"] = mem.delta
        row["gpu_extra_peak_bytes"] = torch.cuda.max_memory_allocated() - base_alloc
        row["durable_gbps"] = nbytes / row["durable_s"] / 1e9
        row["cache_dropped"] = why is None
        on_disk = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        row["bytes_on_disk"] = on_disk
        results["cases"].append(row)
        print(f"{case:22s} stall {row['stall_s']:8.3f} s  durable {row['durable_s']:8.3f} s "
              f"({row['durable_gbps']:.2f} GB/s)  host +{mem.delta / 1e9:6.2f} GB  "
              f"GPU +{row['gpu_extra_peak_bytes'] / 1e9:6.2f} GB  {row.get('snapshot', '')}", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        os.sync()
    ceil = [c["durable_s"] for c in results["cases"] if c["case"].startswith("ceiling")]
    if ceil:
        best = min(ceil)
        for c in results["cases"]:
            c["durable_vs_ceiling"] = best / c["durable_s"]
        print(f"write ceiling: {nbytes / best / 1e9:.2f} GB/s (best of {len(ceil)} runs of 3 write patterns)")
        for c in results["cases"]:
            print(f"  {c['case']:22s} durable {c['durable_vs_ceiling']:.2f}x the ceiling")
    (outdir / "bench_save.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
