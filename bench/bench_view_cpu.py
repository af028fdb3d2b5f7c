"""Warm host load (no GPU) of rank 1 of world size 8 read from another layout (fsdp2-ws4, through
reshard._C.SourceRankView, what reshard.load uses without the job's rank file) beside the same
rank's own fsdp2-ws8 rank file: a CPU-only check of the view's fixed costs (buffers, planning).

    python bench/bench_view_cpu.py [--workdir DIR] [--reps 7] [--threads 2]

Generates a ~0.96 GB bf16 checkpoint (24 x ([2048, 4096] + [5632, 2048] + [2048])) once, converts it
to fsdp2-ws4 and fsdp2-ws8 with build/reshard, reads the files once (warm), then times each load
`reps` times in this process (targets allocated before the timer; the view's open and planning
inside it, as in reshard.load) and prints medians and the process's peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=str(REPO / ".work" / "bench-view-cpu"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    from reshard import _C
    from reshard.layout import torch_dtype

    work = Path(args.workdir)
    src, out = work / "src", work / "out"
    if not (src / "model.safetensors").exists():
        src.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        t = {}
        for i in range(24):
            t[f"layers.{i}.a.weight"] = torch.randn(2048, 4096, generator=g).to(torch.bfloat16)
            t[f"layers.{i}.b.weight"] = torch.randn(5632, 2048, generator=g).to(torch.bfloat16)
            t[f"layers.{i}.n.weight"] = torch.randn(2048, generator=g).to(torch.bfloat16)
        save_file(t, str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps({"model_type": "test"}))
    for ws in (4, 8):
        if not (out / f"fsdp2-ws{ws}").exists():
            subprocess.run([str(Path(args.build_dir) / "reshard"), "convert", str(src), "-o", str(out),
                            "--world-size", str(ws)], check=True, env=dict(os.environ, RESHARD_MODEL_CAPTURE="0"))
    files = sorted(p for d in ("fsdp2-ws4", "fsdp2-ws8") for p in (out / d).glob("*.reshard"))
    for f in files:  # warm
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass

    def view_load():
        v = _C.SourceRankView.of_layout(str(out), "fsdp2-ws4", 8, 1)
        ts = {t.name: torch.empty(t.local_shape, dtype=torch_dtype(t.dtype)) for t in v.tensors}
        tg = [_C.LoadTarget(n, t.data_ptr(), t.numel() * t.element_size(), False) for n, t in ts.items() if t.numel()]
        t0 = time.perf_counter()
        v = _C.SourceRankView.of_layout(str(out), "fsdp2-ws4", 8, 1)
        r = v.load(tg, device=0, threads=args.threads, verify=True)
        return time.perf_counter() - t0, r.bytes

    def rank_load():
        f = str(sorted((out / "fsdp2-ws8").glob("*.reshard"))[1])
        h = json.loads(_C._testing.read_header(f))
        ts = {e["name"]: torch.empty(e["nbytes"], dtype=torch.uint8) for e in h["tensors"]}
        tg = [(n, t.data_ptr(), t.numel(), False) for n, t in ts.items() if t.numel()]
        t0 = time.perf_counter()
        _C._testing.load_raw(f, tg, threads=args.threads, verify=True)
        return time.perf_counter() - t0, sum(e["nbytes"] for e in h["tensors"])

    print(f"rank 1 of 8, warm, host targets, {args.threads} threads, {args.reps} reps (medians)")
    for name, fn in (("own rank file (fsdp2-ws8)", rank_load), ("from fsdp2-ws4 (view)", view_load)):
        fn()
        runs = sorted(fn() for _ in range(args.reps))
        s, nbytes = runs[len(runs) // 2]
        print(f"{name:28s} {1e3 * s:8.1f} ms  {nbytes / s / 1e9:6.2f} GB/s  "
              f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
