#!/usr/bin/env python3
"""The offline reshard of a saved training checkpoint (`reshard relayout`, issue 23) against the
disk's read+write ceiling, with its peak host memory at several checkpoint sizes.

For each --sizes GB (cached in --workdir): a Llama-shaped bf16 model (hidden 2048, intermediate
5632, vocabulary 32000, as many layers as the size takes) under FSDP2 at world size 1 (one gloo
process, CPU), one AdamW step on random gradients (exp_avg / exp_avg_sq in bf16, as the
parameters), `reshard.save(model, CKPT, optimizer)`: weights + optimizer state ~3x the weights.
Then, --reps times each, cold (sync, page cache dropped, the output gone):

* ceiling: every file of the saved layout (rank files and optim/) copied to new files on the
  same disk and fsynced, --copy-threads threads taking 64 MiB ranges (preadv, pwrite), so reads
  and writes overlap, the faster of two ways (dirty pages written at the fsync, or each range
  handed to the disk at once with sync_file_range): the least any relayout must do (each byte
  read once, written once) -- GB/s = the saved layout's bytes / seconds;
* reshard: `reshard relayout CKPT --world-size M` (a child process; the wall time from its start
  to its exit, its peak RSS from wait4): GB/s on the same bytes.

The new layout is removed (and reshard.json restored) after each run. --parts K, for a disk that
cannot hold the checkpoint and its relayout at once (the ~7B one on the 64 GB GPU machine): the
relayout runs as K commands with --ranks (as a job split by target rank runs it) and the ceiling
copies a 1/K share at a time, each part's output removed before the next; seconds are summed. Prints a table and writes
JSON to --out.

    python3 bench/bench_relayout.py --sizes 1,4 --world-size 4 --reps 3 --out results/relayout.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_caches, machine_info, utc_now  # noqa: E402

HIDDEN, INTER, VOCAB = 2048, 5632, 32000


def make_saved(path: Path, size_gb: float, log, chunk_size: int = 0) -> dict:
    """A saved FSDP2 ws1 checkpoint of about size_gb GB of bf16 weights (+ AdamW state), saved
    with chunk_size-byte checksum chunks (0: reshard.save's default)."""
    stamp = path / "bench-stamp.json"
    if stamp.exists():
        return json.loads(stamp.read_text())
    if path.exists():
        shutil.rmtree(path)
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER  # q,k,v,o (no GQA) + MLP
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer))
    code = f"""
import os, torch, torch.distributed as dist, transformers
from torch.distributed.fsdp import fully_shard
import reshard
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29577")
dist.init_process_group("gloo", rank=0, world_size=1)
# A CPU mesh named outright: fully_shard's default mesh is CUDA's on a GPU machine.
mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
cfg = transformers.LlamaConfig(vocab_size={VOCAB}, hidden_size={HIDDEN}, intermediate_size={INTER},
    num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")
g = torch.Generator().manual_seed(0)
# Random values tiled from one 32 MiB block, gradients a multiple of the weights: normal_ with
# a generator runs on one core (166 s for the 4 GB checkpoint of run R2), a copy on all of them.
block = (torch.randn(16 << 20, generator=g) * 0.02).to(torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        flat = p.to_local().view(-1)
        for at in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - at)
            flat[at:at + n].copy_(block[:n])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
for p in model.parameters():
    p.grad = torch.distributed.tensor.DTensor.from_local(p.to_local() * 1e-3, p.device_mesh, p.placements)
opt.step()
reshard.save(model, {str(path)!r}, optimizer=opt, step=1{f", chunk_size={chunk_size}" if chunk_size else ""})
dist.destroy_process_group()
"""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS=str(os.cpu_count() or 1))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_relayout: making the saved checkpoint failed:\n{p.stderr[-3000:]}")
    files = saved_files(path)
    desc = {"layers": layers, "bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "seconds": round(time.perf_counter() - t0, 1)}
    stamp.write_text(json.dumps(desc))
    log(f"saved checkpoint {path}: {layers} layers, {desc['bytes'] / 1e9:.2f} GB in {len(files)} files "
        f"({desc['seconds']} s)")
    return desc


def saved_files(path: Path) -> list:
    return sorted(f for f in (path / "fsdp2-ws1").rglob("*") if f.is_file())


def ceiling_copy(files, scratch: Path, threads: int, push: bool, part: int = 0, parts: int = 1) -> float:
    """Seconds to copy every file to scratch on the same disk and fsync it: `threads` threads
    take 64 MiB ranges in order (preadv into their own buffer, pwrite at the same offset), so
    reads and writes overlap as a relayout's do. push: each range handed to the disk at once
    (sync_file_range WRITE) instead of left dirty until the fsync. part of parts: only that
    share of the ranges (a disk that cannot hold a whole copy beside the source is timed a
    share at a time, each share's copy removed before the next)."""
    import ctypes
    import mmap
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    scratch.mkdir(parents=True, exist_ok=True)
    block = 64 << 20
    t0 = time.perf_counter()
    pairs = []
    for i, f in enumerate(files):
        src = os.open(f, os.O_RDONLY)
        dst = os.open(scratch / f"copy-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        size = os.fstat(src).st_size
        os.ftruncate(dst, size)
        pairs.append((src, dst, size))
    jobs = [(src, dst, off, min(block, size - off)) for src, dst, size in pairs for off in range(0, size, block)]
    jobs = jobs[part * len(jobs) // parts:(part + 1) * len(jobs) // parts]
    lock, nxt = threading.Lock(), [0]

    def worker():
        buf = mmap.mmap(-1, block)
        while True:
            with lock:
                if nxt[0] >= len(jobs):
                    return
                src, dst, off, n = jobs[nxt[0]]
                nxt[0] += 1
            got = os.preadv(src, [memoryview(buf)[:n]], off)
            os.pwrite(dst, memoryview(buf)[:got], off)
            if push:
                libc.sync_file_range(dst, ctypes.c_int64(off), ctypes.c_int64(got), 2)  # SYNC_FILE_RANGE_WRITE

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for src, dst, _ in pairs:
        os.fsync(dst)
        os.close(src)
        os.close(dst)
    seconds = time.perf_counter() - t0
    shutil.rmtree(scratch)
    return seconds


def _vm_hwm(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_relayout(reshard: str, ckpt: Path, ws: int, threads: int, ranks: str = "", chunk_size: int = 0) -> dict:
    """The command's wall time from start to exit and its peak RSS: the high-water mark of its
    own memory (VmHWM, read every 10 ms until it exits; wait4's ru_maxrss would include this
    script's RSS at the fork, which Linux carries across exec). ranks: --ranks A-B."""
    cmd = [reshard, "relayout", str(ckpt), "--world-size", str(ws), "--json"]
    if ranks:
        cmd += ["--ranks", ranks]
    if threads:
        cmd += ["--threads", str(threads)]
    if chunk_size:
        cmd += ["--chunk-size", str(chunk_size)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hwm = 0
    while p.poll() is None:
        hwm = max(hwm, _vm_hwm(p.pid))
        time.sleep(0.01)
    seconds = time.perf_counter() - t0
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"bench_relayout: {' '.join(cmd)} failed (exit {p.returncode}):\n{err[-3000:]}")
    return {"seconds": seconds, "peak_rss_bytes": hwm, "summary": json.loads(out or "{}")}


def undo(ckpt: Path, ws: int, manifest: bytes, write_to: str = "") -> None:
    new = ckpt / f"fsdp2-ws{ws}"
    if new.is_symlink():
        new.unlink()
    shutil.rmtree(new, ignore_errors=True)
    if write_to:
        shutil.rmtree(Path(write_to) / new.name, ignore_errors=True)
    (ckpt / "reshard.json").write_bytes(manifest)


def redirect(ckpt: Path, ws: int, write_to: str) -> None:
    """The new layout's directory as a link to an empty one under write_to (--write-to)."""
    if write_to:
        target = Path(write_to) / f"fsdp2-ws{ws}"
        target.mkdir(parents=True)
        (ckpt / f"fsdp2-ws{ws}").symlink_to(target, target_is_directory=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4", help="GB of bf16 weights per checkpoint, comma separated")
    ap.add_argument("--world-size", type=int, default=4, help="the new layout's world size (saved at 1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="reshard relayout --threads (default: its own)")
    ap.add_argument("--copy-threads", type=int, default=4, help="threads of the copy ceiling (default 4)")
    ap.add_argument("--workdir", default=str(REPO / ".work" / "bench-relayout"))
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--out", default=None, help="JSON results (default WORKDIR/bench-relayout.json)")
    ap.add_argument("--parts", type=int, default=1,
                    help="for a disk that cannot hold the saved checkpoint and its relayout at once: the relayout "
                         "runs as PARTS commands with --ranks (as a job split by target rank does), each part's "
                         "rank files timed and removed before the next, and the ceiling copies a 1/PARTS share at "
                         "a time; seconds are summed")
    ap.add_argument("--chunk-size", type=int, default=0,
                    help="checksum chunk of the saved checkpoint and of the relayout's files (0: the defaults of "
                         "reshard.save and reshard relayout)")
    ap.add_argument("--write-to", default="",
                    help="for a disk that can hold the saved checkpoint but not its relayout beside it: the new "
                         "layout (through a symbolic link CKPT/fsdp2-wsM -> WRITE_TO/fsdp2-wsM) and the ceiling's "
                         "copies are written to this directory on another file system (e.g. /dev/shm); both then "
                         "read the disk and write there, so the ratio is that of the read side, whole")
    ap.add_argument("--ceiling", choices=("both", "dirty", "push"), default="both",
                    help="the copy ceiling's write-back: the faster of both (default), or one")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    reshard = str(Path(args.build_dir) / "reshard")
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:8.1f}s] {msg}", flush=True)

    parts = max(1, min(args.parts, args.world_size))
    result = {"date": utc_now(), "machine": machine_info(work), "world_size": args.world_size, "parts": parts,
              "write_to": args.write_to or None,
              "chunk_size": args.chunk_size or None, "command": " ".join([sys.executable, *sys.argv]), "sizes": []}
    for size in [float(s) for s in args.sizes.split(",") if s.strip()]:
        ckpt = work / (f"saved-{size:g}gb" + (f"-c{args.chunk_size}" if args.chunk_size else ""))
        desc = make_saved(ckpt, size, log, args.chunk_size)
        manifest = (ckpt / "reshard.json").read_bytes()
        undo(ckpt, args.world_size, manifest, args.write_to)
        files = saved_files(ckpt)
        scratch = Path(args.write_to) / "scratch" if args.write_to else work / "scratch"
        nbytes = sum(f.stat().st_size for f in files)
        ceil, runs = [], []
        pushes = {"both": (False, True), "dirty": (False,), "push": (True,)}[args.ceiling]
        for rep in range(args.reps):
            best = None
            for push in pushes:
                t = 0.0
                for part in range(parts):
                    drop_caches()
                    t += ceiling_copy(files, scratch, args.copy_threads, push, part, parts)
                best = t if best is None else min(best, t)
            ceil.append(best)
            r = {"seconds": 0.0, "peak_rss_bytes": 0, "parts": []}
            new_bytes = 0
            for part in range(parts):
                drop_caches()
                redirect(ckpt, args.world_size, args.write_to)
                ranks = f"{part * args.world_size // parts}-{(part + 1) * args.world_size // parts - 1}"
                p = run_relayout(reshard, ckpt, args.world_size, args.threads, ranks if parts > 1 else "",
                                args.chunk_size)
                r["seconds"] += p["seconds"]
                r["peak_rss_bytes"] = max(r["peak_rss_bytes"], p["peak_rss_bytes"])
                r["parts"].append({"ranks": ranks, **p})
                new_bytes += sum(f.stat().st_size for f in (ckpt / f"fsdp2-ws{args.world_size}").rglob("*")
                                 if f.is_file())
                undo(ckpt, args.world_size, manifest, args.write_to)
            runs.append(r)
            log(f"{size:g} GB rep {rep + 1}: ceiling {nbytes / ceil[-1] / 1e9:.3f} GB/s ({ceil[-1]:.2f} s); "
                f"relayout {nbytes / r['seconds'] / 1e9:.3f} GB/s ({r['seconds']:.2f} s), peak RSS "
                f"{r['peak_rss_bytes'] / 2**20:.0f} MiB, wrote {new_bytes / 1e9:.2f} GB")
        c, s = statistics.median(ceil), statistics.median(r["seconds"] for r in runs)
        result["sizes"].append({
            "size_gb": size, "checkpoint": desc, "saved_bytes": nbytes, "ceiling_seconds": ceil,
            "relayout": runs, "ceiling_gbps": round(nbytes / c / 1e9, 3),
            "relayout_gbps": round(nbytes / s / 1e9, 3), "ratio_to_ceiling": round(c / s, 3),
            "peak_rss_mib": round(max(r["peak_rss_bytes"] for r in runs) / 2**20, 1)})
    print(f"\nreshard relayout fsdp2-ws1 -> fsdp2-ws{args.world_size}, cold, medians of {args.reps}")
    print(f"{'saved GB':>9} {'ceiling GB/s':>13} {'relayout GB/s':>14} {'ratio':>6} {'peak RSS MiB':>13}")
    for s in result["sizes"]:
        print(f"{s['saved_bytes'] / 1e9:9.2f} {s['ceiling_gbps']:13.3f} {s['relayout_gbps']:14.3f} "
              f"{s['ratio_to_ceiling']:6.2f} {s['peak_rss_mib']:13.0f}")
    out = Path(args.out) if args.out else work / "bench-relayout.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
