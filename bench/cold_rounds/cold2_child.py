#!/usr/bin/env python3
"""One cold load of a rank file in a fresh process (run AF, issue 20), as bench_load.py's child
does it, with extra counters. Variants (argv[1] = JSON spec, key "variant"):
  A  unprepared: targets allocated, page cache dropped, timer, load (staging made in the timer)
  B  prepared as bench_load's reshard-t16-prepared: _C.prepare(wait=False) before the targets,
     then the drop, then the timer
  C  prepared after the drop: targets allocated, drop, _C.prepare(wait=True), then the timer
  E  as B with a 64 MiB prepared pool (slot_bytes 2 MiB x 16 lanes x 2 slots), the size the
     unprepared cold load makes for itself (8 lanes x 2 slots x 4 MiB): B's pool is 128 MiB
Prints one line '@@RESULT {json}'. Counters: the block device's /sys stat over the timed load
(reads, sectors, ms), THP state of the pinned staging mappings (smaps), vmstat thp deltas."""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_load import RESULT_TAG, ReshardLoad, residency  # noqa: E402
from common import drop_caches  # noqa: E402


def blockstat(path):
    st = os.stat(path)
    p = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
    try:
        v = [int(x) for x in open(p).read().split()]
        return {"reads": v[0], "merged": v[1], "sectors": v[2], "read_ms": v[3], "inflight": v[8],
                "io_ms": v[9]}
    except OSError:
        return None


def vmstat(keys=("thp_fault_alloc", "thp_fault_fallback", "pgfault")):
    out = {}
    for line in open("/proc/vmstat"):
        k, v = line.split()
        if k in keys:
            out[k] = int(v)
    return out


def meminfo(keys=("MemFree", "MemAvailable", "Cached", "AnonHugePages")):
    out = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":")
        if k in keys:
            out[k] = int(v.split()[0])
    return out


def big_anon_maps():
    """Anonymous mappings of 60-260 MiB (the pinned staging: 64 or 128 MiB) with their THP."""
    res, cur = [], None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            cur = {"mib": (hi - lo) / 2**20, "name": parts[5] if len(parts) > 5 else ""}
            if 60 <= cur["mib"] <= 260 and not cur["name"]:
                res.append(cur)
        elif cur is not None and parts[0] in ("AnonHugePages:", "Rss:", "Locked:"):
            cur[parts[0][:-1]] = int(parts[1])
        elif cur is not None and parts[0] == "VmFlags:":
            cur["flags"] = " ".join(parts[1:])
    return res


def main():
    spec = json.loads(sys.argv[1])
    v = spec["variant"]
    out = {"variant": v, "ok": False}
    try:
        import torch
        from reshard import _C
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
        torch.cuda.synchronize()
        vm0 = vmstat()
        spec = dict(spec, prepare=(v == "B"), device="cuda", cuda_device=0)
        t_set = time.perf_counter()
        if v == "E":
            _C.prepare(0, spec["threads"], slot_bytes=2 << 20, wait=False)
        loader = ReshardLoad(spec, device)
        torch.cuda.synchronize()
        out["setup_s"] = round(time.perf_counter() - t_set, 3)
        out["mem_before_drop"] = meminfo()
        t_drop = time.perf_counter()
        why = drop_caches()
        if why:
            raise RuntimeError(why)
        out["drop_s"] = round(time.perf_counter() - t_drop, 3)
        if v == "C":
            t_p = time.perf_counter()
            _C.prepare(0, spec["threads"], wait=True)
            out["prepare_after_drop_s"] = round(time.perf_counter() - t_p, 4)
        out["resident_before"] = round(residency(loader.files), 4)
        out["mem_after_drop"] = meminfo()
        b0 = blockstat(spec["rank_file"])
        t0 = time.perf_counter()
        loader.run()
        torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        b1 = blockstat(spec["rank_file"])
        nbytes = sum(t.numel() * t.element_size() for t in loader.tensors.values())
        out.update(seconds=sec, bytes=nbytes, gbps=nbytes / sec / 1e9, ok=True)
        if b0 and b1:
            d = {k: b1[k] - b0[k] for k in b0 if k != "inflight"}
            d["avg_read_kib"] = d["sectors"] * 512 / 1024 / d["reads"] if d["reads"] else 0
            d["ms_per_read"] = d["read_ms"] / d["reads"] if d["reads"] else 0
            out["block"] = d
        out["report"] = {k: v for k, v in loader.report.items()}
        vm1 = vmstat()
        out["vmstat_delta"] = {k: vm1[k] - vm0.get(k, 0) for k in vm1}
        out["staging_maps"] = big_anon_maps()
    except BaseException as e:  # noqa: BLE001
        import traceback
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
    print(RESULT_TAG + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
