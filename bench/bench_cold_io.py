"""Cold-cache I/O modes of the loader, side by side in one process (GPU machine, root).

For each rank file given: one warm load first (CUDA context, copier and pinned staging set
up, not timed), then for each repetition and each mode (direct, readahead, buffered) the page
cache is dropped and the file is loaded into preallocated CUDA tensors; the sequential-read
ceiling (reshard_bench_ceilings read, 1 thread, 16 MiB) is measured cold in the same loop.
GB = 1e9 bytes landed. Prints a table and writes JSON (--json-out)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from common import CEILINGS, cuda_targets, must_drop_caches
from reshard import _C


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--modes", default="direct,readahead,buffered")
    ap.add_argument("--ceilings", default=str(CEILINGS))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    results = {}
    for path in args.files:
        dests, targets, nbytes = cuda_targets(json.loads(_C._testing.read_header(path)))
        _C._testing.load_raw(path, targets, device=0, threads=args.threads, io="buffered")  # set-up, untimed
        runs = {m: [] for m in args.modes.split(",") + ["ceil-seq-read"]}
        for _ in range(args.reps):
            for mode in runs:
                must_drop_caches()
                if mode == "ceil-seq-read":
                    out = subprocess.run([args.ceilings, "read", "--file", path, "--threads", "1",
                                          "--request", str(16 << 20)], check=True,
                                         capture_output=True, text=True).stdout
                    runs[mode].append(json.loads(out)["gbps"])
                    continue
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = _C._testing.load_raw(path, targets, device=0, threads=args.threads, io=mode)
                torch.cuda.synchronize()
                runs[mode].append(nbytes / (time.perf_counter() - t0) / 1e9)
                assert r["bytes"] == nbytes
        results[path] = {"bytes": nbytes, "gbps": runs,
                         "median": {m: statistics.median(v) for m, v in runs.items()}}
        med = results[path]["median"]
        print(f"{os.path.basename(path)} ({nbytes / 1e9:.3f} GB), cold GB/s, median of {args.reps}:")
        for m, v in runs.items():
            ratio = med[m] / med["ceil-seq-read"]
            print(f"  {m:14s} {med[m]:6.2f}  [{min(v):.2f}-{max(v):.2f}]  {ratio:.2f} x seq-read ceiling")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
