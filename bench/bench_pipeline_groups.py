#!/usr/bin/env python3
"""The warm pipeline ceiling (page cache -> pinned staging -> GPU) with fewer, larger copies.

Runs `reshard_bench_ceilings pipeline` on one file that is in the page cache: the plain
per-thread loop (each thread: pread -> its own 2 pinned buffers -> a copy per read) against
`--group G` (the threads read into one pinned ring of K blocks of G reads each; whoever reads
a block's last piece copies the whole block), and the pinned H2D ceilings. Every variant is
its own process; the variants are interleaved round by round, round 0 is discarded, and the
medians are printed with their ratio to the H2D ceiling (2 GiB in 64 MiB copies, 4 streams)
of the same run.

Usage (repo root, build/ built with CUDA, on the GPU machine):
  python3 bench/bench_pipeline_groups.py FILE [--make-bytes 1749000000] [--set w1|w2]
      [--rounds 8] [--json-out PATH]
FILE is made of random bytes when --make-bytes is given and FILE does not exist; it is read
once before the first round. bench/HISTORY.md §7, run W.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import BUILD, read_files


def grouped(request: str, group: int, ring: int, streams: int = 4) -> list[str]:
    return ["pipeline", "--threads", "16", "--request", request, "--group", str(group),
            "--ring", str(ring), "--streams", str(streams)]


def plain(request: str) -> list[str]:
    return ["pipeline", "--threads", "16", "--request", request]


CEILING = "h2d 64MiB x4 streams (2GiB)"

SETS = {
    # Run W1: copy size and ring size at 2 MiB reads, and the H2D curve by copy size.
    "w1": {
        "pipe-2MiB (ceil-pipeline)": plain("2MiB"),
        "pipe-4MiB (loader-like)": plain("4MiB"),
        "grp 2MiBx1 ring32 s4 (2MiB copies, 64MiB)": grouped("2MiB", 1, 32),
        "grp 2MiBx4 ring8 s4 (8MiB, 64MiB)": grouped("2MiB", 4, 8),
        "grp 2MiBx8 ring4 s4 (16MiB, 64MiB)": grouped("2MiB", 8, 4),
        "grp 2MiBx8 ring8 s4 (16MiB, 128MiB)": grouped("2MiB", 8, 8),
        "grp 2MiBx8 ring8 s1 (16MiB, 128MiB)": grouped("2MiB", 8, 8, 1),
        "grp 2MiBx16 ring4 s4 (32MiB, 128MiB)": grouped("2MiB", 16, 4),
        "grp 4MiBx4 ring8 s4 (16MiB, 128MiB)": grouped("4MiB", 4, 8),
        "grp 1MiBx16 ring4 s4 (16MiB, 64MiB)": grouped("1MiB", 16, 4),
        "grp 1MiBx16 ring8 s4 (16MiB, 128MiB)": grouped("1MiB", 16, 8),
        "h2d 4MiB x16 streams (FILE bytes)": ["h2d", "--bytes", "FILE", "--reps", "1", "--threads", "16", "--request", "4MiB"],
        "h2d 16MiB x4 streams (FILE bytes)": ["h2d", "--bytes", "FILE", "--reps", "1", "--threads", "4", "--request", "16MiB"],
        CEILING: ["h2d", "--bytes", "2GiB", "--reps", "1", "--threads", "4", "--request", "64MiB"],
    },
    # Run W2: read size and ring size at 16 MiB copies.
    "w2": {
        "pipe-4MiB (loader-like)": plain("4MiB"),
        "pipe-1MiB": plain("1MiB"),
        "grp 2MiBx8 ring4 (16MiB, 64MiB)": grouped("2MiB", 8, 4),
        "grp 1MiBx16 ring4 (16MiB, 64MiB)": grouped("1MiB", 16, 4),
        "grp 1MiBx16 ring4 s1": grouped("1MiB", 16, 4, 1),
        "grp 1MiBx8 ring8 (8MiB, 64MiB)": grouped("1MiB", 8, 8),
        "grp 1MiBx4 ring16 (4MiB, 64MiB)": grouped("1MiB", 4, 16),
        "grp 1MiBx16 ring2 (16MiB, 32MiB)": grouped("1MiB", 16, 2),
        "grp 512KiBx32 ring4 (16MiB, 64MiB)": grouped("512KiB", 32, 4),
        "grp 256KiBx64 ring4 (16MiB, 64MiB)": grouped("256KiB", 64, 4),
        "grp 1MiBx32 ring4 (32MiB, 128MiB)": grouped("1MiB", 32, 4),
        CEILING: ["h2d", "--bytes", "2GiB", "--reps", "1", "--threads", "4", "--request", "64MiB"],
    },
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--make-bytes", type=int, default=0, help="make FILE of this many random bytes if it is missing")
    ap.add_argument("--set", choices=sorted(SETS), default="w1")
    ap.add_argument("--rounds", type=int, default=8, help="rounds, the first discarded (default 8)")
    ap.add_argument("--build-dir", default=str(BUILD))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds: at least 2 (round 0 is discarded)")
    tool = Path(args.build_dir) / "tools" / "bench" / "reshard_bench_ceilings"
    if not tool.exists():
        sys.exit(f"bench_pipeline_groups: {tool} not found; build with -DRESHARD_WITH_CUDA=ON first")
    f = Path(args.file)
    if not f.exists():
        if not args.make_bytes:
            sys.exit(f"bench_pipeline_groups: {f} does not exist (give --make-bytes N to make it)")
        with open(f, "wb") as out:
            left = args.make_bytes
            while left:
                n = min(left, 64 << 20)
                out.write(os.urandom(n))
                left -= n
    size = f.stat().st_size
    read_files([f], 64 << 20)  # into the page cache
    variants = SETS[args.set]
    res: dict[str, list[float]] = {k: [] for k in variants}
    failures: dict[str, str] = {}
    for rnd in range(args.rounds):
        for name, a in variants.items():
            argv = [str(tool)] + [str(size) if x == "FILE" else x for x in a]
            if a[0] == "pipeline":
                argv += ["--file", str(f)]
            p = subprocess.run(argv, capture_output=True, text=True)
            lines = p.stdout.strip().splitlines()
            if p.returncode != 0 or not lines:
                failures[name] = (p.stderr.strip() or f"exit {p.returncode}, no output")[-300:]
                print(f"FAILED {name}: {failures[name]}", flush=True)
                continue
            j = json.loads(lines[-1])
            cached = j.get("resident_fraction_before")
            if cached is not None and cached < 0.99:  # a warm ceiling needs the file cached
                failures[name] = f"round {rnd}: only {cached:.2f} of the file was in the page cache"
                print(f"FAILED {name}: {failures[name]}", flush=True)
                continue
            if rnd > 0:
                res[name].append(j["gbps"])
    ceiling = statistics.median(res[CEILING]) if res[CEILING] else None
    for name, xs in res.items():
        if not xs:
            continue
        m = statistics.median(xs)
        ratio = f"  /h2d-64MiB {m / ceiling:.3f}" if ceiling else ""
        print(f"{name:45s} {m:6.2f} GB/s [{min(xs):.2f}-{max(xs):.2f}] n={len(xs)}{ratio}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"file_bytes": size, "set": args.set, "gbps": res,
                                                   "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
