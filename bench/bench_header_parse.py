"""Parsing of safetensors headers with many tensors: `reshard inspect` (and `convert`) beside
the safetensors library reading the same header (issue 25: 40,000 tensors took 9-12 s and
10^6 over 15 minutes, quadratic; the target is at most 2x safetensors' time).

Each file holds N one-byte U8 tensors named like a model's ("model.layers.<i>.weight"), so
nearly all of the time is the header (N = 10^6: a 62 MB header). Timed: the child's wall
clock, best of --reps, after the file has been read once (warm page cache). Not a test: no
threshold is asserted; prints a table, --json-out writes JSON.

    python bench/bench_header_parse.py --reshard build/reshard --tensors 40000 1000000
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

SAFETENSORS_READ = r'''
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as f:
    print(len(list(f.keys())))
'''


def write_file(path: str, n: int) -> int:
    parts = []
    for i in range(n):
        parts.append('"model.layers.%d.weight":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'
                     % (i, i, i + 1))
    header = ("{" + ",".join(parts) + "}").encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(b"\x01" * n)
    return len(header)


def best_of(cmd, reps: int, timeout: float) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reshard", default="build/reshard")
    ap.add_argument("--python", default=sys.executable, help="a Python with safetensors")
    ap.add_argument("--tensors", type=int, nargs="+", default=[40000, 1000000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--convert", action="store_true", help="also time convert --world-size 1")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for n in args.tensors:
            path = os.path.join(work, f"n{n}.safetensors")
            header = write_file(path, n)
            with open(path, "rb") as f:  # warm the page cache
                f.read()
            row = {"tensors": n, "header_bytes": header}
            row["safetensors_s"] = best_of([args.python, "-c", SAFETENSORS_READ, path], args.reps,
                                           args.timeout)
            row["inspect_s"] = best_of([args.reshard, "inspect", path, "--json"], args.reps,
                                       args.timeout)
            if args.convert:
                out = os.path.join(work, f"out{n}")
                row["convert_s"] = best_of([args.reshard, "convert", path, "-o", out,
                                            "--world-size", "1", "--force"], 1, args.timeout)
            row["inspect_vs_safetensors"] = row["inspect_s"] / row["safetensors_s"]
            rows.append(row)
            print(f"{n:>9} tensors, header {header / 1e6:7.1f} MB: safetensors "
                  f"{row['safetensors_s']:7.2f} s, reshard inspect {row['inspect_s']:7.2f} s "
                  f"({row['inspect_vs_safetensors']:.2f}x)"
                  + (f", convert {row['convert_s']:7.2f} s" if "convert_s" in row else ""),
                  flush=True)
            os.remove(path)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
