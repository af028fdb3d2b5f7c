#!/usr/bin/env python3
"""What this disk gives a reader of the bytes one rank loads straight from the Hugging Face
files, by reader shape: threads (requests in flight), request size, order, O_DIRECT or not.

The question (issue 23, bench/HISTORY.md §14): a cold load from the HF files reads a part of
every tensor (rank r of W: rows r/W of each) and runs at 0.6-0.76x the rank file's one
sequential file; a plain 16-thread O_DIRECT reader of exactly those ranges does no better
(run AS). Whether another depth, request size or order would is what this measures.

Every measurement drops the page cache first and reads another rank's bytes than the one
before (ranks taken in turn), so no two successive measurements read the same bytes. The
sequential baseline reads, per measurement, a contiguous stretch of the same HF files of the
same size as a rank's bytes (a different stretch each time). Reader: `reshard_bench_ceilings
ranges` (tools/bench/ceilings.cc). GB/s are of the listed bytes.

  python bench/bench_cold_ranges.py --build-dir build-gpu --size-gb 14 --world-size 8 \
      --configs 16:4MiB:list:direct,64:1MiB:spread:direct --reps 3
Config: THREADS:REQUEST:ORDER:IO, ORDER list|spread|shuffle, IO direct|buffered; the
sequential baseline is config "seq" (1 thread, 16 MiB, buffered: the kernel's read-ahead,
as bench_load's ceil-seq-read) and "seqd" (8 threads, 4 MiB, O_DIRECT: the rank-file loader's
cold reader shape).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import make_checkpoint  # noqa: E402
from common import REPO, drop_caches, machine_info, utc_now  # noqa: E402

KV_HEADS = 8  # as bench_load.py: the same checkpoint when the workdir is shared


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--workdir", default="/tmp/bench-load")
    ap.add_argument("--size-gb", type=float, default=14)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--configs", default="seq,seqd,16:4MiB:list:direct,16:4MiB:spread:direct,"
                    "32:2MiB:spread:direct,64:1MiB:spread:direct,64:4MiB:spread:direct,"
                    "128:1MiB:spread:direct,64:1MiB:shuffle:direct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting repetitions after this")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t_start = time.monotonic()
    tool = Path(args.build_dir) / "tools" / "bench" / "reshard_bench_ceilings"
    if not tool.exists():
        tool = Path(args.build_dir) / "reshard_bench_ceilings"
    if not tool.exists():
        raise SystemExit(f"bench_cold_ranges: no reshard_bench_ceilings under {args.build_dir}; build it "
                         "(cmake --build BUILD --target reshard_bench_ceilings)")
    why = drop_caches()
    if why:
        raise SystemExit(f"bench_cold_ranges: {why}")
    sys.path.insert(0, str(REPO / "python"))
    from reshard import _C

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"ckpt-{args.size_gb:g}gb"
    ck = make_checkpoint(src, args.size_gb, kv_heads=KV_HEADS, file_gb=max(0.25, args.size_gb / 4),
                         log=lambda m: print(m, flush=True))
    files = sorted(src.glob("*.safetensors"))
    lists = []
    rank_bytes = []
    for r in range(args.world_size):
        ranges = _C.SourceRankView.of_checkpoint(str(src), args.world_size, r).read_ranges()
        p = work / f"cold-ranges-hf-rank{r}-of{args.world_size}.txt"
        p.write_text("".join(f"{off} {n} {path}\n" for path, off, n in ranges))
        lists.append((str(p), len(ranges)))
        rank_bytes.append(sum(n for _, _, n in ranges))
    want = rank_bytes[0] // 4096 * 4096
    seq_lists = []  # contiguous stretches of the HF files, each as many bytes as a rank's
    for f in files:
        size = f.stat().st_size
        for k in range(size // want):
            p = work / f"cold-ranges-seq-{len(seq_lists)}.txt"
            p.write_text(f"{k * want} {want} {f}\n")
            seq_lists.append(str(p))
    if not seq_lists:
        raise SystemExit("bench_cold_ranges: the HF files are smaller than a rank's bytes")
    print(f"{len(files)} HF files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB; rank bytes "
          f"{rank_bytes[0] / 1e9:.3f} GB in {lists[0][1]} ranges; {len(seq_lists)} sequential stretches",
          flush=True)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    argv_of = {}
    for c in configs:
        if c == "seq":
            argv_of[c] = ["--threads", "1", "--request", "16MiB"]
        elif c == "seqd":
            argv_of[c] = ["--threads", "8", "--request", "4MiB", "--direct"]
        else:
            parts = c.split(":")
            if len(parts) != 4 or parts[3] not in ("direct", "buffered"):
                raise SystemExit(f"bench_cold_ranges: config {c!r}: expected THREADS:REQUEST:ORDER:direct|buffered")
            argv_of[c] = ["--threads", parts[0], "--request", parts[1], "--order", parts[2]] + (
                ["--direct"] if parts[3] == "direct" else [])
    results = {c: [] for c in configs}
    turn = {"rank": 0, "seq": 0}
    for rep in range(args.reps):
        if args.budget_s and rep and time.monotonic() - t_start > args.budget_s:
            print(f"budget: {rep} repetitions", flush=True)
            break
        order = configs if rep % 2 == 0 else list(reversed(configs))  # drift falls on both sides
        for c in order:
            if c in ("seq", "seqd"):
                lst = seq_lists[turn["seq"] % len(seq_lists)]
                turn["seq"] += 1
            else:
                lst = lists[turn["rank"] % len(lists)][0]
                turn["rank"] += 1
            why = drop_caches()
            if why:
                raise SystemExit(why)
            out = subprocess.run([str(tool), "ranges", "--list", lst, *argv_of[c]], capture_output=True,
                                 text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"bench_cold_ranges: {c}: {out.stderr.strip() or out.stdout.strip()}")
            j = json.loads(out.stdout)
            results[c].append({"gbps": j["gbps"], "seconds": j["seconds"], "list": lst})
            print(f"rep {rep} {c:28s} {j['gbps']:6.2f} GB/s  ({Path(lst).name})", flush=True)
    summary = {}
    base = statistics.median(r["gbps"] for r in results["seq"]) if results.get("seq") else None
    print("\nconfig                        median GB/s  [min-max]      x seq")
    for c in configs:
        v = [r["gbps"] for r in results[c]]
        if not v:
            continue
        med = statistics.median(v)
        summary[c] = {"median": med, "min": min(v), "max": max(v), "n": len(v)}
        ratio = f"{med / base:5.2f}x" if base else ""
        print(f"{c:28s} {med:8.2f}    [{min(v):.2f}-{max(v):.2f}]   {ratio}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": utc_now(), "machine": machine_info(work), "argv": sys.argv, "checkpoint": ck,
            "rank_bytes": rank_bytes[0], "ranges": lists[0][1], "results": results, "summary": summary},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
