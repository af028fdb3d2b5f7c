#!/usr/bin/env python3
"""Benchmark `reshard export` (rank files → Hugging Face safetensors checkpoint): throughput
and peak RSS, against I/O ceilings measured in the same run.

One run:
1. makes (or reuses) the shared Llama-shaped bf16 checkpoint (bench/bench_checkpoint.py) and
   converts it once (untimed) for world size W, raw, and once with --compress zstd;
2. measures, interleaved in each repetition (warm page cache; the first repetition discarded):
   - ceiling "read": the rank files read sequentially into an 8 MiB buffer;
   - ceiling "read+write+fsync": the same reads appended to one file, then fsync (export
     fsyncs every file it writes, so this is the comparison at equal durability);
   - ceiling "cat+fsync": `cat rank files > file`, then fsync of that file (the same copy done
     by coreutils; on this VM Python's write loop is slower than cat's, see bench/HISTORY.md §9);
     ratios are given against each ceiling and against the faster of the two;
   - `reshard export` of the raw layout into one model.safetensors (default --max-shard-size),
     into 1 GB shards (--max-shard-size 1GB), and of the zstd layout;
   each export is a child process timed by wall clock, with its own peak RSS and CPU seconds
   from /usr/bin/time (a wait4 from this process would start from this process's RSS);
   before every timed run the previous output is removed and `sync` runs (untimed);
3. checks the first output of each kind: every tensor's bytes equal the source's (compared
   with the source files chunk by chunk, by offsets read from both headers).

GB = 1e9 bytes of tensor data everywhere, so GB/s ratios are ratios of times.
Usage: bench/bench_export.py [--size-gb 2.5] [--world-size 8] [--reps 3] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench_checkpoint import make_checkpoint  # shared generator
from common import REPO, ceiling_read, ceiling_rw, machine_info, noise_snapshot, time_child, utc_now

KV_HEADS = 32


def st_header(path: Path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return 8 + n, h


def check_output(src: Path, hf: Path) -> int:
    """Every tensor of the export equals the source's, byte for byte; returns bytes compared."""
    where = {}
    for p in sorted(src.glob("*.safetensors")):
        base, h = st_header(p)
        for k, v in h.items():
            where[k] = (p, base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0],
                        v["dtype"], v["shape"])
    seen, compared = set(), 0
    for p in sorted(hf.glob("*.safetensors")):
        base, h = st_header(p)
        with open(p, "rb") as out:
            for k, v in h.items():
                sp, soff, n, dtype, shape = where[k]
                assert (dtype, shape) == (v["dtype"], v["shape"]), k
                assert v["data_offsets"][1] - v["data_offsets"][0] == n, k
                with open(sp, "rb") as s:
                    s.seek(soff)
                    out.seek(base + v["data_offsets"][0])
                    left = n
                    while left:
                        m = min(left, 64 << 20)
                        if s.read(m) != out.read(m):
                            sys.exit(f"{p}: tensor {k} differs from the source")
                        left -= m
                compared += n
                seen.add(k)
    if seen != set(where):
        sys.exit(f"{hf}: tensors missing or extra: {sorted(set(where) ^ seen)[:5]}")
    return compared


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.5)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=str(REPO / ".work" / "bench"))
    ap.add_argument("--reshard", default=str(REPO / "build" / "reshard"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"llama-{args.size_gb:g}gb"
    t_start = time.perf_counter()
    ck = make_checkpoint(src, args.size_gb, kv_heads=KV_HEADS, file_gb=1.0,
                         log=lambda m: print(m, flush=True))
    nbytes = ck["tensor_bytes"]
    ws = args.world_size
    outs = {"raw": work / f"export-src-ws{ws}", "zstd": work / f"export-src-ws{ws}-zstd"}
    for kind, out in outs.items():
        cmd = [args.reshard, "convert", str(src), "-o", str(out), "--world-size", str(ws)]
        if kind == "zstd":
            cmd += ["--compress", "zstd"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rank_files = sorted((outs["raw"] / f"fsdp2-ws{ws}").glob("rank-*.reshard"))
    zstd_stored = sum(p.stat().st_size for p in (outs["zstd"] / f"fsdp2-ws{ws}").glob("rank-*.reshard"))
    threads = ["--threads", str(args.threads)] if args.threads else []
    hf = work / "export-hf"
    ceiling_dst = work / "export-ceiling.bin"

    def export_cmd(kind, *extra):
        return [args.reshard, "export", str(outs[kind]), "-o", str(hf), *threads, *extra]

    paths = {
        "ceiling_read": None,
        "ceiling_read_write_fsync": None,
        "ceiling_cat_fsync": None,
        "export_raw_one_file": export_cmd("raw"),
        "export_raw_1GB_shards": export_cmd("raw", "--max-shard-size", "1GB"),
        "export_zstd_one_file": export_cmd("zstd"),
    }
    results = {k: [] for k in paths}
    checked = {}
    machine = machine_info(work)
    noise = noise_snapshot()
    for rep in range(args.reps + 1):
        for name, cmd in paths.items():
            shutil.rmtree(hf, ignore_errors=True)
            ceiling_dst.unlink(missing_ok=True)
            os.sync()
            if name == "ceiling_read":
                rec = {"s": ceiling_read(rank_files)}
            elif name == "ceiling_read_write_fsync":
                rec = {"s": ceiling_rw(rank_files, ceiling_dst, fsync=True)}
            elif name == "ceiling_cat_fsync":
                t0 = time.perf_counter()
                with open(ceiling_dst, "wb") as f:
                    subprocess.run(["cat", *map(str, rank_files)], stdout=f, check=True)
                    os.fsync(f.fileno())
                rec = {"s": time.perf_counter() - t0}
            else:
                wall, usage, rc, out, err = time_child(cmd)
                if rc != 0:
                    sys.exit(f"failed ({rc}): {' '.join(cmd)}\n{err}")
                rec = {"s": wall, "rss_mib": usage["rss_kib"] / 1024 if usage["rss_kib"] else None,
                       "cpu_s": usage.get("user_s", 0) + usage.get("sys_s", 0)}
                if name not in checked:
                    checked[name] = {"bytes_compared": check_output(src, hf),
                                     "files": sorted(p.name for p in hf.iterdir())}
            if rep:  # the first repetition warms the page cache
                results[name].append(rec)
            print(f"rep {rep} {name}: {rec['s']:.2f} s", flush=True)
    shutil.rmtree(hf, ignore_errors=True)
    ceiling_dst.unlink(missing_ok=True)

    summary = {}
    for name, recs in results.items():
        times = [r["s"] for r in recs]
        med = statistics.median(times)
        s = {"median_s": round(med, 3), "gbps": round(nbytes / med / 1e9, 3),
             "gbps_min": round(nbytes / max(times) / 1e9, 3),
             "gbps_max": round(nbytes / min(times) / 1e9, 3), "runs_s": [round(t, 3) for t in times]}
        if recs and "rss_mib" in recs[0]:
            s["peak_rss_mib"] = round(max(r["rss_mib"] for r in recs), 1)
            s["cpu_s"] = round(statistics.median(r["cpu_s"] for r in recs), 2)
        summary[name] = s
    ratios = {}
    best = min(summary["ceiling_read_write_fsync"]["median_s"], summary["ceiling_cat_fsync"]["median_s"])
    for k in paths:
        if k.startswith("export"):
            for c in ("ceiling_read_write_fsync", "ceiling_cat_fsync"):
                ratios[f"{k}_vs_{c}"] = round(summary[c]["median_s"] / summary[k]["median_s"], 3)
            ratios[f"{k}_vs_best_write_ceiling"] = round(best / summary[k]["median_s"], 3)
    report = {
        "date": utc_now(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine, "noise_at_start": noise, "checkpoint": ck, "tensor_bytes": nbytes,
        "world_size": ws, "zstd_stored_bytes": zstd_stored, "reps": args.reps,
        "results": summary, "ratios": ratios, "checked": checked,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    print(f"\n{nbytes / 1e9:.3f} GB of tensors, world size {ws}, warm, median of {args.reps} [min-max]:")
    for name, s in summary.items():
        extra = f"  peak RSS {s['peak_rss_mib']:.1f} MiB  CPU {s['cpu_s']:.2f} s" if "peak_rss_mib" in s else ""
        print(f"  {name:28s} {s['median_s']:6.2f} s  {s['gbps']:.2f} GB/s "
              f"[{s['gbps_min']:.2f}-{s['gbps_max']:.2f}]{extra}")
    for k, v in ratios.items():
        print(f"  {k}: {v}")
    verified = ", ".join(f"{k} ({v['bytes_compared']} bytes)" for k, v in checked.items())
    print(f"  verified: {verified}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
