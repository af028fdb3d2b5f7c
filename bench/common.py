"""What the benchmark programs in bench/ share: the repository's paths, the page cache (drop it,
warm it), a description of the machine and of its load, a child process timed with its own peak
RSS, the I/O ceilings of convert and export, and the FSDP2 row rule with the `safe_open` row
slices the peers and the checks read.

Imported as `common` by the programs next to it (`python3 bench/NAME.py` puts bench/ first on
sys.path); nothing here imports torch or safetensors at import time.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build"
CEILINGS = BUILD / "tools" / "bench" / "reshard_bench_ceilings"  # tools/bench/ceilings.cc
BUF = 8 << 20  # the convert/export ceilings' buffer (reshard's pread/pwrite size)


def utc_now() -> str:
    """The date and time a result records, e.g. "2026-11-30 07:43 UTC"."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --------------------------------------------------------------------------------------------
# page cache
# --------------------------------------------------------------------------------------------
def drop_caches() -> str | None:
    """sync; echo 3 > /proc/sys/vm/drop_caches. Returns None, or why it failed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot write /proc/sys/vm/drop_caches ({e}); cold runs need root"


def must_drop_caches() -> None:
    """drop_caches(), or exit with why it failed."""
    why = drop_caches()
    if why:
        raise SystemExit(why)


def read_files(paths, bufsize: int = 16 << 20) -> float:
    """Reads the files once (to warm the page cache); returns seconds."""
    buf = bytearray(bufsize)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(mv):
                pass
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------
def machine_info(workdir: Path) -> dict:
    """CPU, memory, kernel, the disk holding workdir, the GPUs (nvidia-smi), Python, load."""
    mem = ""
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal"):
            mem = f"{int(line.split()[1]) / 1048576:.1f} GiB"
    cpu = ""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    df = subprocess.run(["df", "-h", str(workdir)], capture_output=True, text=True).stdout.strip()
    dev = df.splitlines()[-1].split()[0] if df else ""
    rot = ""
    name = os.path.basename(dev)
    if os.path.exists(f"/sys/block/{name}/queue/rotational"):
        rot = open(f"/sys/block/{name}/queue/rotational").read().strip()
    gpu = ""
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_total": mem, "kernel": platform.release(),
            "df": df, "block_device_rotational_flag": rot, "gpu": gpu,
            "python": sys.version.split()[0],
            "loadavg_start": open("/proc/loadavg").read().split()[:3]}


def noise_snapshot() -> dict:
    """Load indicators at the start of a run (the machine may be shared: bench/HISTORY.md §2)."""
    snap = {"loadavg1": float(open("/proc/loadavg").read().split()[0])}
    try:
        line = open("/proc/pressure/cpu").readline()  # "some avg10=.. avg60=.."
        snap["cpu_pressure_avg10"] = float(line.split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        pass
    for line in open("/proc/meminfo"):
        if line.startswith("Dirty:"):
            snap["dirty_mib"] = round(int(line.split()[1]) / 1024)
    return snap


# --------------------------------------------------------------------------------------------
# a child process, timed, with its own peak RSS
# --------------------------------------------------------------------------------------------
# Peak RSS of a child must not be read with wait4 from a large process: on Linux a child's
# ru_maxrss starts at its parent's RSS at fork/exec time (a benchmark holding torch and
# buffers), which would hide the child's own peak. A small process in between (GNU time, or
# a bare python -S forker) makes the fork-time baseline a few MiB.
_RSS_WRAPPER = (
    "import os,sys\n"
    "pid=os.fork()\n"
    "if pid==0:\n"
    "    os.execvp(sys.argv[2],sys.argv[2:])\n"
    "_,st,ru=os.wait4(pid,0)\n"
    "open(sys.argv[1],'w').write(str(ru.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(st))\n")


def time_child(cmd, env=None):
    """Runs cmd; returns (wall s, {peak RSS KiB, user s, sys s}, returncode, stdout, stderr)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".rss") as rssf:
        if os.path.exists("/usr/bin/time"):
            full = ["/usr/bin/time", "-q", "-f", "%M %U %S", "-o", rssf.name, *cmd]
        else:
            full = [sys.executable, "-S", "-c", _RSS_WRAPPER, rssf.name, *cmd]
        t0 = time.perf_counter()
        p = subprocess.run(full, stdout=out, stderr=err, env=env)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        lines = open(rssf.name).read().strip().splitlines()
        f = lines[-1].split() if lines else []
        usage = {"rss_kib": int(f[0]) if f and f[0].isdigit() else None}
        if len(f) == 3:
            usage["user_s"], usage["sys_s"] = float(f[1]), float(f[2])
        return wall, usage, p.returncode, out.read().decode(), err.read().decode()


# --------------------------------------------------------------------------------------------
# ceilings of convert and export (in-process, userspace buffers like reshard's pread/pwrite)
# --------------------------------------------------------------------------------------------
def ceiling_read(files) -> float:
    """The files read sequentially into one BUF-sized buffer and discarded; returns seconds."""
    buf = bytearray(BUF)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while os.readv(fd, [mv]) > 0:
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def ceiling_rw(files, dst: Path, fsync: bool) -> float:
    """The same reads appended to dst with write (then fsync, if asked); returns seconds."""
    buf = bytearray(BUF)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                while True:
                    n = os.readv(fd, [mv])
                    if n <= 0:
                        break
                    w = 0
                    while w < n:
                        w += os.write(out, mv[w:n])
            finally:
                os.close(fd)
        if fsync:
            os.fsync(out)
    finally:
        os.close(out)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# FSDP2 rows and the source's row slices
# --------------------------------------------------------------------------------------------
def fsdp_rows(n: int, w: int, r: int):
    """Rows [start, end) of dim 0 (n rows) that rank r of world size w holds (torch.chunk)."""
    c = -(-n // w)
    return min(r * c, n), min((r + 1) * c, n)


def source_handles(src: Path):
    """(weight_map, {file: safe_open handle}) of a checkpoint directory with an index."""
    from safetensors import safe_open

    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    handles = {f: safe_open(str(src / f), framework="pt")
               for f in sorted(set(weight_map.values()))}
    return weight_map, handles


def rank_slice(handle, name: str, ws: int, rank: int):
    """Rank `rank`'s rows of tensor `name` of a safe_open handle (0-dim tensors: whole)."""
    sl = handle.get_slice(name)
    shape = sl.get_shape()
    if not shape:
        return handle.get_tensor(name)
    s, e = fsdp_rows(shape[0], ws, rank)
    return sl[s:e]


def cuda_targets(header: dict):
    """One preallocated CUDA byte buffer per tensor of a rank file's header (as `_C._testing.read_header`
    returns it): (buffers, `_C._testing.load_raw` targets, tensor bytes in all)."""
    import torch

    dests, targets = [], []
    for e in header["tensors"]:
        t = torch.empty(max(e["nbytes"], 1), dtype=torch.uint8, device="cuda")
        dests.append(t)
        targets.append((e["name"], t.data_ptr(), e["nbytes"], True))
    return dests, targets, sum(e["nbytes"] for e in header["tensors"])
