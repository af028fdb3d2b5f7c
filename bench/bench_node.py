#!/usr/bin/env python3
"""Benchmark a whole node's load: every rank of a world size loading at once, as a job does.

bench_load.py times one rank alone. In a job, the ranks of a node load at the same time, and
what the disk sees is all of them together: from the job's rank files, N sequential files at
once; straight from the Hugging Face files (or from another world size's layout), N readers
each taking its part of every tensor, which together cover the source files whole. This script
measures that, on however many GPUs the machine has (ranks are placed round-robin on them; a
1-GPU machine holds all ranks of a 14 GB model in its memory):

1. makes (or reuses) the Llama-shaped checkpoint of bench_load.py (--size-gb), and
   `reshard convert`s it for --world-size and --view-ws into one OUT;
2. for each series -- rank (each rank's fsdp2-wsN rank file), hf (SourceRankView of the
   Hugging Face files), wsM (SourceRankView of the fsdp2-wsM layout) -- and each mode (cold:
   page cache dropped after every process is set up; warm: the series' files read once first),
   starts --world-size processes; each imports torch, starts the copy engine (`_C.prepare`, as
   reshard.empty_model does), allocates its rank's tensors on its GPU and waits; then all are
   released at once and each times its load (planning included) to the device synchronized;
3. the node's figure: bytes landed by all ranks / (last end - first start). Ceiling (cold):
   the series' source files read whole at once, one reader process per file
   (`reshard_bench_ceilings read --direct`, 16 MiB requests): what the disk gives for those
   bytes read sequentially;
4. checks that every series lands the same bytes in every rank (a SHA-1 per rank, first
   repetition): the rank files against the Hugging Face files read by another path
   (bench_load.py checks the rank files against safe_open slices).

Usage (repo root, built; on the GPU machine):
  python3 bench/bench_node.py --build-dir build-gpu --size-gb 14 --world-size 8 --view-ws 4
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import make_checkpoint  # noqa: E402
from bench_load import KV_HEADS, ReshardLoad, ReshardView, convert, rank_file  # noqa: E402
from common import REPO, drop_caches, machine_info, read_files, utc_now  # noqa: E402


def _worker(spec, ready, go, results):
    """One rank: set up, wait, load, report (time.time() stamps: one clock for all)."""
    try:
        import torch
        ngpu = torch.cuda.device_count()
        dev = torch.device("cuda", spec["rank"] % ngpu) if ngpu else torch.device("cpu")
        if ngpu:
            torch.cuda.set_device(dev)
        spec = dict(spec, cuda_device=dev.index or 0, prepare=bool(ngpu))
        loader = ReshardLoad(spec, dev) if spec["kind"] == "reshard" else ReshardView(spec, dev)
        if ngpu:
            torch.cuda.synchronize()
        ready.wait()
        go.wait()
        t0 = time.time()
        tensors = loader.run()
        if ngpu:
            torch.cuda.synchronize()
        t1 = time.time()
        r = loader.report
        rep = dict(r) if isinstance(r, dict) else {"bytes": r.bytes, "cold": r.cold, "direct_io": r.direct_io,
                                                    "threads": r.threads, "stored_bytes": r.stored_bytes}
        out = {"rank": spec["rank"], "t0": t0, "t1": t1, "bytes": sum(t.numel() * t.element_size()
                                                                     for t in tensors.values()),
               "report": {k: rep.get(k) for k in ("bytes", "stored_bytes", "cold", "direct_io", "threads")}}
        if spec.get("digest"):
            h = hashlib.sha1()
            for name in sorted(tensors):
                h.update(name.encode())
                h.update(tensors[name].detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
            out["sha1"] = h.hexdigest()
        results.put(out)
    except BaseException as e:  # noqa: BLE001 -- reported, the parent fails the series
        results.put({"rank": spec.get("rank"), "error": f"{type(e).__name__}: {e}"})
        try:
            ready.abort()
            go.abort()
        except Exception:  # noqa: BLE001
            pass


def run_series(name, specs, mode, files, log, timeout=600):
    """Starts one process per spec, releases them together; returns the record."""
    ctx = mp.get_context("spawn")
    n = len(specs)
    ready, go, results = ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Queue()
    if mode == "warm":
        read_files(files)
    procs = [ctx.Process(target=_worker, args=(s, ready, go, results)) for s in specs]
    for p in procs:
        p.start()
    err = None
    try:
        ready.wait(timeout=timeout)
        if mode == "cold":
            err = drop_caches()
        go.wait(timeout=timeout)
    except Exception as e:  # noqa: BLE001 -- a worker failed in its set-up
        err = f"set-up failed: {type(e).__name__}"
    got = []
    deadline = time.time() + timeout
    while len(got) < n and time.time() < deadline:
        try:
            got.append(results.get(timeout=max(1.0, deadline - time.time())))
        except Exception:  # noqa: BLE001
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [g["error"] for g in got if "error" in g]
    if err or errors or len(got) < n:
        return {"series": name, "mode": mode, "ok": False,
                "error": errors[0] if errors else err or f"{n - len(got)} of {n} ranks did not report"}
    got.sort(key=lambda g: g["rank"])
    wall = max(g["t1"] for g in got) - min(g["t0"] for g in got)
    total = sum(g["bytes"] for g in got)
    rec = {"series": name, "mode": mode, "ok": True, "seconds": wall, "bytes": total, "gbps": total / wall / 1e9,
           "rank_seconds": [round(g["t1"] - g["t0"], 4) for g in got],
           "reports": [g["report"] for g in got]}
    if any("sha1" in g for g in got):
        rec["sha1"] = [g.get("sha1") for g in got]
    log(f"  {mode:4s} {name:10s} {rec['gbps']:7.2f} GB/s  {wall:7.3f} s  ranks "
        f"{min(rec['rank_seconds']):.3f}-{max(rec['rank_seconds']):.3f} s  "
        f"direct {sum(bool(r.get('direct_io')) for r in rec['reports'])}/{n}")
    return rec


def ceiling(tool, files, log):
    """The files read whole at once, one O_DIRECT reader process per file."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([tool, "read", "--file", f, "--threads", "1", "--request", "16MiB", "--direct"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for f in files]
    errs = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - t0
    bad = [e for p, e in zip(procs, errs) if p.returncode != 0]
    if bad:
        return {"ok": False, "error": bad[0][-500:]}
    total = sum(os.path.getsize(f) for f in files)
    log(f"  cold ceiling ({len(files)} files at once) {total / wall / 1e9:7.2f} GB/s  {wall:7.3f} s  "
        f"({total / 1e9:.2f} GB)")
    return {"ok": True, "seconds": wall, "bytes": total, "gbps": total / wall / 1e9}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=14)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--view-ws", type=int, default=4, help="also load from this world size's layout (0: no)")
    ap.add_argument("--series", default="rank,hf,view",
                    help="rank, hf, hf-direct (the HF files read with O_DIRECT), view (comma separated)")
    ap.add_argument("--modes", default="cold,warm")
    ap.add_argument("--threads", type=int, default=8, help="loader threads per rank (default 8)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting repetitions after this many seconds")
    ap.add_argument("--workdir", default=str(REPO / ".work" / "bench-load"))
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--out", default=None, help="JSON path (default WORKDIR/bench-node.json)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:8.1f}s] {msg}", flush=True)

    build = Path(args.build_dir)
    reshard, tool = build / "reshard", build / "tools" / "bench" / "reshard_bench_ceilings"
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / f"ckpt-{args.size_gb:g}gb"
    ck = make_checkpoint(src, args.size_gb, kv_heads=KV_HEADS, file_gb=max(0.25, args.size_gb / 4), log=log)
    out = workdir / f"out-{args.size_gb:g}gb"
    sizes = sorted({args.world_size} | ({args.view_ws} if args.view_ws else set()), reverse=True)
    conv = convert(str(reshard), src, out, sizes, ck, log)
    ws = args.world_size
    want = [s.strip() for s in args.series.split(",") if s.strip()]
    base = {"src": str(src), "ws": ws, "threads": args.threads, "verify": True, "io": "auto", "check": "sample"}
    series = {}
    for s in want:
        if s == "rank":
            series["rank"] = ([dict(base, kind="reshard", rank=r, rank_file=str(rank_file(out, ws, r)))
                               for r in range(ws)], [str(rank_file(out, ws, r)) for r in range(ws)])
        elif s in ("hf", "hf-direct"):  # hf-direct: O_DIRECT reads (the default before d487d99)
            series[s] = ([dict(base, kind="view", view="checkpoint", rank=r, io="direct" if s == "hf-direct" else "auto")
                          for r in range(ws)], sorted(str(p) for p in src.glob("*.safetensors")))
        elif s == "view" and args.view_ws:
            v = f"fsdp2-ws{args.view_ws}"
            series[f"ws{args.view_ws}"] = ([dict(base, kind="view", view=v, out=str(out), rank=r) for r in range(ws)],
                                           sorted(str(p) for p in (out / v).glob("*.reshard")))
        else:
            raise SystemExit(f"bench_node: --series {s!r}: expected rank, hf, hf-direct or view (with --view-ws)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    result = {"date": utc_now(), "machine": machine_info(workdir), "argv": sys.argv, "checkpoint": ck,
              "convert": conv, "world_size": ws, "threads_per_rank": args.threads, "runs": [], "ceilings": []}
    out_json = Path(args.out) if args.out else workdir / "bench-node.json"
    names = list(series)
    one_rep = None
    for rep in range(args.reps):
        t_rep = time.perf_counter()
        if rep and args.budget_s and (time.perf_counter() - t_start) + one_rep > args.budget_s:
            log(f"budget {args.budget_s:g} s: stopped after {rep} repetition(s)")
            break
        log(f"repetition {rep + 1}/{args.reps}")
        order = names[rep % len(names):] + names[:rep % len(names)]  # a different series first each time
        for mode in modes:
            for name in order:
                specs, files = series[name]
                if mode == "cold" and tool.exists():
                    why = drop_caches()
                    if why:
                        raise SystemExit(why)
                    c = ceiling(str(tool), files, log)
                    result["ceilings"].append(dict(c, series=name, rep=rep))
                specs = [dict(s, digest=(rep == 0 and mode == modes[-1])) for s in specs]
                rec = run_series(name, specs, mode, files, log)
                rec["rep"] = rep
                result["runs"].append(rec)
                if not rec["ok"]:
                    log(f"  {mode} {name}: FAILED: {rec['error']}")
        one_rep = time.perf_counter() - t_rep
        out_json.write_text(json.dumps(result, indent=1))
    # Every series the same bytes in every rank.
    digests = {r["series"]: r["sha1"] for r in result["runs"] if r.get("ok") and r.get("sha1")}
    same = len({tuple(d) for d in digests.values()}) == 1 and len(digests) == len(series)
    result["same_bytes"] = {"ok": same, "series": sorted(digests)}
    log(f"every series landed the same bytes in every rank: {'OK' if same else 'NO'} ({sorted(digests)})")
    summary = {}
    for name in names:
        for mode in modes:
            g = [r["gbps"] for r in result["runs"] if r["series"] == name and r["mode"] == mode and r["ok"]]
            if g:
                summary[f"{mode}/{name}"] = {"median_gbps": statistics.median(g), "min": min(g), "max": max(g), "n": len(g)}
        c = [x["gbps"] for x in result["ceilings"] if x["series"] == name and x["ok"]]
        if c:
            summary[f"ceiling/{name}"] = {"median_gbps": statistics.median(c), "min": min(c), "max": max(c), "n": len(c)}
    result["summary"] = summary
    out_json.write_text(json.dumps(result, indent=1))
    log(f"node of {ws} ranks, {args.threads} threads each (GB/s of all ranks' bytes, median [min-max]):")
    for k, v in summary.items():
        ref = summary.get(f"{k.split('/')[0]}/rank", {}).get("median_gbps") if not k.startswith("ceiling") else None
        ratio = f"  {v['median_gbps'] / ref:.2f}x rank files" if ref else ""
        log(f"  {k:14s} {v['median_gbps']:7.2f} [{v['min']:.2f}-{v['max']:.2f}] n={v['n']}{ratio}")
    log(f"done: {out_json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
