"""Running multi-process tests: torchrun --standalone with this interpreter, gloo on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def dist_env(**extra):
    """The environment of a test's child processes: the package importable, one thread each;
    a process killed by a signal (SIGABRT, SIGSEGV) prints every thread's Python stack."""
    paths = [os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONFAULTHANDLER="1", **extra)


def torchrun(nproc, script, *args, timeout=300, env=None):
    """Runs `script` (or "-m", module) in `nproc` processes (`env`: more environment
    variables); asserts that all exit 0."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *map(str, [script, *args])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dist_env(**(env or {})), timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=REPO)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc
