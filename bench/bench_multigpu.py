"""Multi-GPU validation (issue 9): every rank loads only its own file, with NCCL, one process per
GPU, compared with accelerate's FSDP2 cpu_ram_efficient_loading and DCP's
HuggingFaceStorageReader on the same model in the same run.

Steps (all on the machine with the GPUs, N = number of visible GPUs unless --world-size):
1. a Llama-shaped bf16 checkpoint of --size-gb (bench/bench_checkpoint.py; 16 GB ≈ 8B params);
2. `reshard convert` for world size N, FSDP2 and FSDP1 (model manifest by python -m
   reshard.manifest), then `reshard verify --source` of both (every byte);
3. the aggregate storage ceiling: all N rank files read at once, cold (page cache dropped);
4. cold runs (page cache dropped before each): `torchrun -m reshard.train OUT` (FSDP2) and
   `--fsdp1`, a few training steps each, per rank load time, peak host RSS, GPU memory after the
   load; then accelerate (FSDP2, cpu_ram_efficient_loading) and DCP HuggingFaceStorageReader
   (FSDP2) from job start until the model is loaded;
5. weights: the loader checks every chunk's checksum against files verified byte for byte
   against the source in step 2, and --check-weights compares the gathered weights with
   from_pretrained on a subset run (--check-weights-ranks) when asked;
6. writes JSON and a Markdown table into --outdir.

Usage: python3 bench/bench_multigpu.py --size-gb 16 --outdir $OUT
       python3 bench/bench_multigpu.py --cpu-smoke   # tiny, CPU/gloo, 2 processes, no peers
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_checkpoint
from common import REPO, drop_caches

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]),
           TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="4")


def log(msg):
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd, timeout=1800, env=None, check=True):
    t0 = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env or ENV)
    dt_s = time.perf_counter() - t0
    if check and p.returncode != 0:
        raise RuntimeError(f"$ {' '.join(map(str, cmd))}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p, dt_s


PEER_ACCELERATE = r'''
import json, os, sys, time, resource
t0 = time.perf_counter()
import torch, torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM
src, outdir = sys.argv[1], sys.argv[2]
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True,
                                        auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
                                        state_dict_type="SHARDED_STATE_DICT")
acc = Accelerator(fsdp_plugin=plugin)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # FSDP2 prepare wants model and optimizer
model, opt = acc.prepare(model, opt)
torch.cuda.synchronize()
dist.barrier()
wall = time.perf_counter() - t0
r = {"rank": acc.process_index, "load_wall_s": wall,
     "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
     "cuda_after_load_bytes": torch.cuda.memory_allocated(), "cuda_peak_bytes": torch.cuda.max_memory_allocated()}
json.dump(r, open(os.path.join(outdir, f"rank-{acc.process_index}.json"), "w"))
dist.destroy_process_group()
'''

PEER_DCP = r'''
import json, os, sys, time, resource
t0 = time.perf_counter()
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM
from accelerate import init_empty_weights
src, outdir = sys.argv[1], sys.argv[2]
local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local)
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = init_device_mesh("cuda", (dist.get_world_size(),))
cfg = AutoConfig.from_pretrained(src)
with init_empty_weights(include_buffers=False):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cuda")
sd = model.state_dict()
dcp.load(sd, storage_reader=HuggingFaceStorageReader(path=src))
torch.cuda.synchronize()
dist.barrier()
wall = time.perf_counter() - t0
r = {"rank": dist.get_rank(), "load_wall_s": wall,
     "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
     "cuda_after_load_bytes": torch.cuda.memory_allocated(), "cuda_peak_bytes": torch.cuda.max_memory_allocated()}
json.dump(r, open(os.path.join(outdir, f"rank-{dist.get_rank()}.json"), "w"))
dist.destroy_process_group()
'''


def read_ranks(d: Path, n: int):
    return [json.load(open(d / f"rank-{r}.json")) for r in range(n)]


def job_done(name, p, res, outdir: Path) -> bool:
    """Writes job `name`'s log into outdir; on failure records it in res. True if it succeeded."""
    (outdir / f"{name}.log").write_text(p.stdout[-20000:] + "\n--- stderr ---\n" + p.stderr[-20000:])
    if p.returncode != 0:
        res[name] = {"rc": p.returncode, "error": p.stderr[-3000:]}
        log(f"{name}: FAILED rc {p.returncode}")
        return False
    return True


def aggregate_read(files, reps=1):
    """All files read at once by one process each (cold): seconds until the last finishes."""
    code = ("import sys,os\nf=os.open(sys.argv[1],os.O_RDONLY)\nb=bytearray(64<<20)\nm=memoryview(b)\n"
            "while os.readv(f,[m]): pass\n")
    best = None
    for _ in range(reps):
        drop_caches()
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", code, str(f)]) for f in files]
        for p in procs:
            p.wait()
        s = time.perf_counter() - t0
        best = s if best is None else min(best, s)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--workdir", default=str(REPO / ".work" / "bench-multigpu"))
    ap.add_argument("--outdir", default=os.environ.get("OUT") or None)
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--check-weights", action="store_true", help="also run FSDP2 with --check-weights")
    ap.add_argument("--skip", default="", help="comma list of: fsdp1,accelerate,dcp")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    import torch

    gpu = torch.cuda.is_available() and not args.cpu_smoke
    n = args.world_size or (torch.cuda.device_count() if gpu else 2)
    work = Path(args.workdir)
    outdir = Path(args.outdir or work / "results")
    outdir.mkdir(parents=True, exist_ok=True)
    reshard = Path(args.build_dir) / "reshard"
    src, out = work / "src", work / "out"
    size = 0.05 if args.cpu_smoke else args.size_gb
    res = {"date": dt.date.today().isoformat(), "world_size": n, "gpu": gpu,
           "gpus": [torch.cuda.get_device_name(i) for i in range(n)] if gpu else [],
           "cpu_count": os.cpu_count(), "size_gb": size}
    log(f"{n} ranks on {'GPUs ' + ', '.join(res['gpus']) if gpu else 'CPU'}; checkpoint {size} GB")

    if args.cpu_smoke:
        bench_checkpoint.HIDDEN, bench_checkpoint.INTER, bench_checkpoint.VOCAB = 256, 688, 1000
    ck = bench_checkpoint.make_checkpoint(src, size, kv_heads=8, file_gb=4, log=log)
    res["checkpoint"] = ck
    shutil.rmtree(out, ignore_errors=True)
    _, t = sh([sys.executable, "-m", "reshard.manifest", src, "-o", out / "reshard-model.json"])
    res["manifest_s"] = t
    for layout in ["fsdp2", "fsdp1"]:
        if layout in skip:
            continue
        p, t = sh([reshard, "convert", src, "-o", out, "--world-size", n, "--layout", layout, "--json"])
        res[f"convert_{layout}"] = {"seconds": t, **json.loads(p.stdout)}
        log(f"convert {layout}: {t:.1f} s ({json.loads(p.stdout)['bytes_read'] / 1e9 / t:.2f} GB/s)")
    p, t = sh([reshard, "verify", out, "--source", src, "--json"], check=False)
    res["verify"] = {"seconds": t, "rc": p.returncode, "report": json.loads(p.stdout) if p.stdout.strip() else None}
    log(f"verify --source: rc {p.returncode} in {t:.1f} s")

    files = sorted((out / res["convert_fsdp2"]["layout"]).glob("rank-*.reshard"))
    total = sum(f.stat().st_size for f in files)
    agg = aggregate_read(files)
    res["ceiling"] = {"aggregate_read_s": agg, "bytes": total, "gbps": total / agg / 1e9,
                      "per_rank_bytes": [f.stat().st_size for f in files]}
    log(f"ceiling: {n} rank files ({total / 1e9:.2f} GB) read at once, cold: {agg:.2f} s ({total / agg / 1e9:.2f} GB/s)")

    torchrun = Path(sys.executable).parent / "torchrun"
    common = ["--steps", args.steps, "--lr", args.lr, "--param-dtype", "checkpoint", "--seq-len", 256 if gpu else 32,
              "--batch-size", 2, "--log-every", 1, "--device", "cuda" if gpu else "cpu"]
    runs = [("reshard-fsdp2", [])] + ([] if "fsdp1" in skip else [("reshard-fsdp1", ["--fsdp1"])])
    if args.check_weights:
        runs.append(("reshard-fsdp2-check", ["--check-weights", str(src)]))
    for name, extra in runs:
        jd = work / name
        shutil.rmtree(jd, ignore_errors=True)
        cold = drop_caches() is None
        p, t = sh([torchrun, "--standalone", "--nproc-per-node", n, "-m", "reshard.train", out, *common,
                   *extra, "--json-out", jd], check=False)
        if not job_done(name, p, res, outdir):
            continue
        reps = read_ranks(jd, n)
        res[name] = {"cold": cold, "job_s": t, "ranks": [{
            "rank": r["rank"], "load_s": r["load"]["seconds"], "load_gbps": r["load"]["gbps"],
            "bytes": r["load"]["bytes"], "load_wall_s": r["load_wall_s"],
            "peak_rss_after_load": r["rss"]["peak_after_load"], "rss_before_load": r["rss"]["before_load"],
            "cuda_after_load": r.get("cuda_after_load_bytes"), "cuda_peak_after_load": r.get("cuda_peak_after_load_bytes"),
            "cuda_peak": r.get("cuda_peak_bytes"), "losses": r["losses"], "layout": r["load"]["layout"]}
            for r in reps]}
        slow = max(x["load_s"] for x in res[name]["ranks"])
        log(f"{name}: slowest rank load {slow:.2f} s, wall to loaded {max(x['load_wall_s'] for x in res[name]['ranks']):.1f} s, "
            f"loss {reps[0]['losses'][0]:.3f} -> {reps[0]['losses'][-1]:.3f}")

    if gpu:
        for name, code, launcher in [("accelerate-fsdp2-cpu-ram-efficient", PEER_ACCELERATE, "accelerate"),
                                     ("dcp-hf-reader-fsdp2", PEER_DCP, "torchrun")]:
            if name.split("-")[0] in skip:
                continue
            jd = work / name
            shutil.rmtree(jd, ignore_errors=True)
            jd.mkdir(parents=True)
            script = work / f"{name}.py"
            script.write_text(code)
            cold = drop_caches() is None
            if launcher == "accelerate":
                cmd = [Path(sys.executable).parent / "accelerate", "launch", "--num_processes", n, "--use_fsdp",
                       "--fsdp_version", "2", "--fsdp_cpu_ram_efficient_loading", "true", "--mixed_precision", "no",
                       "--main_process_port", "29517", script, src, jd]
            else:
                cmd = [torchrun, "--standalone", "--nproc-per-node", n, script, src, jd]
            p, t = sh(cmd, check=False)
            if not job_done(name, p, res, outdir):
                continue
            res[name] = {"cold": cold, "job_s": t, "ranks": read_ranks(jd, n)}
            log(f"{name}: wall to loaded {max(x['load_wall_s'] for x in res[name]['ranks']):.1f} s, peak RSS "
                f"{max(x['peak_rss_bytes'] for x in res[name]['ranks']) / 2**30:.1f} GiB")

    (outdir / "bench-multigpu.json").write_text(json.dumps(res, indent=1))
    lines = ["| run | slowest rank: load s | job start → loaded s (max rank) | peak host RSS GiB (max) | GPU after load GiB (max) |",
             "|---|---|---|---|---|"]
    for name in ["reshard-fsdp2", "reshard-fsdp1", "accelerate-fsdp2-cpu-ram-efficient", "dcp-hf-reader-fsdp2"]:
        r = res.get(name)
        if not r or "ranks" not in r:
            continue
        ranks = r["ranks"]
        load = max(x.get("load_s", float("nan")) for x in ranks)
        wall = max(x["load_wall_s"] for x in ranks)
        rss = max(x.get("peak_rss_after_load", x.get("peak_rss_bytes", 0)) for x in ranks) / 2**30
        gpu_b = max((x.get("cuda_after_load") or x.get("cuda_after_load_bytes") or 0) for x in ranks) / 2**30
        lines.append(f"| {name} | {load:.2f} | {wall:.1f} | {rss:.1f} | {gpu_b:.2f} |")
    ceil = res["ceiling"]
    lines.append(f"\naggregate-storage-bound time (all rank files read at once, cold): {ceil['aggregate_read_s']:.2f} s "
                 f"({ceil['gbps']:.2f} GB/s)")
    for name in ["reshard-fsdp2", "reshard-fsdp1"]:
        if res.get(name, {}).get("ranks"):
            slow = max(x["load_s"] for x in res[name]["ranks"])
            lines.append(f"{name}: slowest rank {slow:.2f} s = {slow / ceil['aggregate_read_s']:.2f} × the aggregate bound")
    (outdir / "bench-multigpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
