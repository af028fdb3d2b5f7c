#!/usr/bin/env python3
"""The loader's tuning knobs measured side by side in one process (GPU machine, root).

For each rank file given, into preallocated CUDA tensors, GB = 1e9 bytes landed:

* warm (file in the page cache): every combination of --threads, span_bytes,
  hash_piece_bytes, slots and lead_in_bytes (checksums on), plus checksums off; staging set up by an untimed load with
  the same knobs, then --reps timed loads;
* cold (page cache dropped before each timed load; io=auto picks the cold path): every
  combination of cold_threads and cold_span_bytes, and io=direct for a few; the
  sequential-read ceiling (reshard_bench_ceilings read: 1 thread, 16 MiB, buffered) measured
  cold in the same loop.

The defaults in include/reshard/runtime/loader.h are chosen from this (bench/HISTORY.md §7). Prints a
table per file and writes JSON (--json-out).

  PYTHONPATH=python python3 bench/bench_loader_knobs.py FILE [FILE ...] --json-out knobs.json
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from common import CEILINGS, cuda_targets, must_drop_caches, read_files
from reshard import _C

MiB = 1 << 20


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--reps", type=int, default=5, help="timed warm loads per configuration")
    ap.add_argument("--cold-reps", type=int, default=2, help="timed cold loads per configuration")
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--spans-mib", default="0,4,8", help="warm span_bytes in MiB (0: one chunk)")
    ap.add_argument("--pieces-kib", default="0,256", help="warm hash_piece_bytes in KiB (0: off)")
    ap.add_argument("--slots", default="2", help="staging slots per thread")
    ap.add_argument("--lead-in-kib", default="1024", help="warm lead_in_bytes in KiB (0: off; default 1024, the loader's)")
    ap.add_argument("--cold-threads", default="2,4,8,16")
    ap.add_argument("--cold-spans-mib", default="2,8,16,32")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--warm-ceilings", action="store_true",
                    help="also measure the warm ceilings (reshard_bench_ceilings) --reps times")
    ap.add_argument("--ceilings", default=str(CEILINGS))
    ap.add_argument("--flush-mib", type=int, default=0, metavar="MIB",
                    help="before each timed warm load, one thread per core writes and reads this "
                         "many MiB in all (reshard_bench_ceilings flush, another process), so that "
                         "no load finds the file or the staging in the CPU caches from the load "
                         "before (the warm ceilings are measured without it)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_loader_knobs: needs CUDA")
    torch.empty(1, device="cuda")
    results = {}
    for path in args.files:
        header = json.loads(_C._testing.read_header(path))
        dests, targets, nbytes = cuda_targets(header)
        res = {"bytes": nbytes, "warm": [], "cold": [], "flush_mib": args.flush_mib,
               "streams_env": os.environ.get("RESHARD_STREAMS", "")}
        print(f"== {path}: {nbytes / 1e9:.3f} GB, {len(targets)} tensors"
              + (f"; CPU caches flushed ({args.flush_mib} MiB) before each warm load" if args.flush_mib else "")
              + (f"; RESHARD_STREAMS={res['streams_env']}" if res["streams_env"] else ""), flush=True)

        # Reference bytes: the file's tensors loaded into host memory (no copier), then put on
        # the GPU; every configuration's last load must equal them (destinations are filled
        # with a pattern first, so a load that lands nothing fails).
        host = [torch.empty(max(e["nbytes"], 1), dtype=torch.uint8) for e in header["tensors"]]
        _C._testing.load_raw(path, [(e["name"], h.data_ptr(), e["nbytes"], False)
                       for e, h in zip(header["tensors"], host)], device=0, io="buffered")
        ref = [h.cuda() for h in host]
        del host

        def poison():
            for d in dests:
                d.fill_(0x5A)

        def check(what):
            bad = [e["name"] for e, d, r in zip(header["tensors"], dests, ref)
                   if e["nbytes"] and not torch.equal(d[:e["nbytes"]], r[:e["nbytes"]])]
            if bad:
                raise SystemExit(f"{path}: {what}: tensors differ from the file: {bad[:5]}")

        flush = [args.ceilings, "flush", "--mib", str(args.flush_mib), "--threads", str(os.cpu_count() or 1)]

        def load(flushed=False, **kw):
            if flushed and args.flush_mib:
                subprocess.run(flush, check=True, stdout=subprocess.DEVNULL)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = _C._testing.load_raw(path, targets, device=0, **kw)
            torch.cuda.synchronize()
            sec = time.perf_counter() - t0
            assert r["bytes"] == nbytes
            return nbytes / sec / 1e9, r

        # ---- warm
        read_files([path], 64 * MiB)
        configs = [dict(threads=t, span_bytes=s * MiB, hash_piece_bytes=p << 10, verify=True, slots=n,
                        lead_in_bytes=li << 10)
                   for t, s, p, n, li in itertools.product(ints(args.threads), ints(args.spans_mib),
                                                           ints(args.pieces_kib), ints(args.slots),
                                                           ints(args.lead_in_kib))]
        configs += [dict(threads=t, span_bytes=0, hash_piece_bytes=0, verify=False, slots=2, lead_in_bytes=0)
                    for t in ints(args.threads)]
        for cfg in configs:
            load(io="buffered", **cfg)  # staging for these knobs, untimed
            g = [load(io="auto", flushed=True, **cfg) for _ in range(args.reps - 1)]
            poison()
            g.append(load(io="auto", flushed=True, **cfg))
            check(f"warm {cfg}")
            phases = {k: statistics.median(r.get(k, 0.0) for _, r in g)
                      for k in ("read_seconds", "wait_seconds", "sync_seconds", "open_seconds", "seconds",
                                "first_copy_seconds", "reads_done_seconds", "lane_start_seconds",
                                "lane_end_seconds", "issue_seconds")}
            rec = {**cfg, "gbps": [x for x, _ in g], "median": statistics.median(x for x, _ in g),
                   "cold_detected": any(r["cold"] for _, r in g), "phases_median": phases,
                   "pooled": all(r.get("pooled") for _, r in g),
                   "span_bytes_used": g[0][1]["span_bytes"], "threads_used": g[0][1]["threads"]}
            res["warm"].append(rec)
            print(f"  warm threads {cfg['threads']:2d} span {cfg['span_bytes'] // MiB:2d} MiB piece "
                  f"{cfg['hash_piece_bytes'] >> 10:4d} KiB "
                  f"slots {cfg['slots']} lead-in {cfg.get('lead_in_bytes', 0) >> 10:4d} KiB "
                  f"verify {int(cfg['verify'])}: "
                  f"{rec['median']:6.2f} GB/s [{min(rec['gbps']):.2f}-{max(rec['gbps']):.2f}]"
                  + f"  ms: load {phases['seconds'] * 1e3:.2f} read {phases['read_seconds'] * 1e3:.2f} "
                  f"wait {phases['wait_seconds'] * 1e3:.2f} sync {phases['sync_seconds'] * 1e3:.2f} "
                  f"open {phases['open_seconds'] * 1e3:.2f} first copy "
                  f"{phases['first_copy_seconds'] * 1e3:.2f} reads done {phases['reads_done_seconds'] * 1e3:.2f} "
                  f"lanes start {phases['lane_start_seconds'] * 1e3:.2f} end {phases['lane_end_seconds'] * 1e3:.2f} "
                  f"issue {phases['issue_seconds'] * 1e3:.2f}"
                  + ("  (found cold!)" if rec["cold_detected"] else ""), flush=True)

        # ---- warm ceilings, measured here too (same minutes, same file): 16 threads page
        # cache -> pinned, the plain pipeline, pinned H2D; ratios to min(read, H2D).
        if args.warm_ceilings:
            tool = {"read-pinned": ["read", "--file", path, "--threads", "16", "--request", "2MiB", "--pinned"],
                    "pipeline": ["pipeline", "--file", path, "--threads", "16", "--request", "2MiB"],
                    "h2d": ["h2d", "--bytes", str(max(nbytes, 256 * MiB)), "--reps", "3", "--threads", "4",
                            "--request", "64MiB"]}
            ceil = {k: [] for k in tool}
            for _ in range(args.reps):
                for k, argv in tool.items():
                    out = subprocess.run([args.ceilings, *argv], check=True, capture_output=True, text=True).stdout
                    ceil[k].append(json.loads(out)["gbps"])
            med = {k: statistics.median(v) for k, v in ceil.items()}
            lower = min(med["read-pinned"], med["h2d"])
            res["warm_ceilings"] = {"gbps": ceil, "median": med, "lower": lower}
            print("  warm ceilings (medians of %d): " % args.reps
                  + ", ".join(f"{k} {v:.2f} [{min(ceil[k]):.2f}-{max(ceil[k]):.2f}]" for k, v in med.items())
                  + f"; lower {lower:.2f} GB/s", flush=True)
            for rec in res["warm"]:
                rec["vs_lower_ceiling"] = rec["median"] / lower
                rec["vs_pipeline"] = rec["median"] / med["pipeline"]
            best = max(res["warm"], key=lambda r: r["median"] if r["verify"] else 0)
            print(f"  best with checksums: {best['median']:.2f} GB/s = {best['vs_lower_ceiling']:.2f}x lower "
                  f"ceiling, {best['vs_pipeline']:.2f}x pipeline"
                  + (" (loads after a flush, ceilings without)" if args.flush_mib else "")
                  + f" ({best['threads']} threads, span "
                  f"{best['span_bytes'] // MiB} MiB, slots {best['slots']})", flush=True)

        # ---- cold
        if not args.no_cold:
            cold_cfgs = [dict(io="auto", threads=16, cold_threads=t, cold_span_bytes=s * MiB)
                         for t, s in itertools.product(ints(args.cold_threads), ints(args.cold_spans_mib))]
            cold_cfgs += [dict(io="direct", threads=16, cold_threads=t, cold_span_bytes=s * MiB)
                          for t, s in ((4, 16), (16, 2), (8, 8))]
            cold_cfgs.append({"ceiling": "seq-read"})
            runs = {i: [] for i in range(len(cold_cfgs))}
            for _ in range(args.cold_reps):
                for i, cfg in enumerate(cold_cfgs):
                    if "ceiling" in cfg:
                        must_drop_caches()
                        out = subprocess.run([args.ceilings, "read", "--file", path, "--threads", "1",
                                              "--request", str(16 * MiB)], check=True,
                                             capture_output=True, text=True).stdout
                        runs[i].append(json.loads(out)["gbps"])
                        continue
                    kw = dict(cfg)
                    load(**{**kw, "io": "readahead"})  # staging for these knobs, untimed
                    poison()
                    must_drop_caches()
                    g, r = load(**kw)
                    check(f"cold {cfg}")
                    if not r["cold"]:
                        raise SystemExit(f"{path}: a cold load was not detected as cold: {r}")
                    runs[i].append(g)
            seq = statistics.median(runs[len(cold_cfgs) - 1])
            for i, cfg in enumerate(cold_cfgs):
                med = statistics.median(runs[i])
                rec = {**cfg, "gbps": runs[i], "median": med, "vs_seq_read": med / seq}
                res["cold"].append(rec)
                name = ("ceiling seq-read (1 thread, 16 MiB)" if "ceiling" in cfg else
                        f"io {cfg['io']:6s} cold_threads {cfg['cold_threads']:2d} span "
                        f"{cfg['cold_span_bytes'] // MiB:2d} MiB")
                print(f"  cold {name}: {med:5.2f} GB/s [{min(runs[i]):.2f}-{max(runs[i]):.2f}] "
                      f"{med / seq:.2f}x seq-read", flush=True)
        results[path] = res
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
