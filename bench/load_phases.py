#!/usr/bin/env python3
"""Where a reshard load's time went, from a bench_load.py JSON: per series, the medians of the
loader's report fields (ms) for the first load in each fresh process and for each later load
in the same process (`2nd load`, and `reshard-tN-prepared-6loads`).

  python3 bench/load_phases.py OUTDIR/bench-load.json

Fields (include/reshard/runtime/loader.h, LoadStats and LoadDiagnostics): seconds = the whole load; read = reading and
hashing, per reader thread; wait = waiting for a staging slot, per thread; sync = waiting for the
copies still in flight after the reads; first_copy = when the first copy was issued;
reads_done = when the last thread finished; lane_start = the latest thread start; lane_end = when
a thread ran out of work (average); issue = issuing copies, per thread; lane_wall = a thread's
time from its start to its end, lane_cpu = the CPU time it used in it (the difference: time not on
a CPU, descheduled or blocked), both averaged; preempt = involuntary context switches of all
reader threads; shared = readers that started on a CPU another reader started on (these two are
counts, not ms).
"""
import argparse
import json
import statistics
import sys

KEYS = ["seconds", "read_seconds", "wait_seconds", "sync_seconds", "first_copy_seconds",
        "reads_done_seconds", "lane_start_seconds", "lane_end_seconds", "issue_seconds",
        "lane_wall_seconds", "lane_cpu_seconds"]
COUNTS = ["preemptions", "lanes_on_shared_cpus"]


def phases_table(d) -> str:
    """The table, from a bench_load result (its JSON, loaded)."""
    runs = [r for r in d["runs"] if r.get("ok") and not r.get("discard") and "loader_report" in r
            and r.get("mode") == "warm"]
    lines = ["warm loads, medians in ms (n = processes)",
             f"{'case / series':44s} {'load':>4s} {'n':>2s} " +
             " ".join(f"{k.replace('_seconds', ''):>10s}" for k in KEYS) + " " +
             " ".join(f"{k:>8s}" for k in ("preempt", "shared"))]
    for case in sorted({r["case"] for r in runs}):
        for label in sorted({r["label"] for r in runs if r["case"] == case}):
            rs = [r for r in runs if r["case"] == case and r["label"] == label]
            loads = [[r["loader_report"] for r in rs]]
            for i in range(max(len(r.get("more_loads", [])) for r in rs)):
                loads.append([r["more_loads"][i]["report"] for r in rs if len(r.get("more_loads", [])) > i])
            for i, reps in enumerate(loads):
                vals = [statistics.median(x.get(k, 0.0) for x in reps) * 1e3 for k in KEYS]
                counts = [statistics.median(x.get(k, 0) for x in reps) for k in COUNTS]
                lines.append(f"{case + ' / ' + label:44s} {i + 1:4d} {len(reps):2d} " +
                             " ".join(f"{v:10.2f}" for v in vals) + " " +
                             " ".join(f"{c:8.1f}" for c in counts))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a bench_load.py result (OUTDIR/bench-load.json)")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        print(phases_table(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
