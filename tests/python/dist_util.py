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


def worker_main(main):
    """Runs a torchrun worker's main() and leaves with its exit code (None: 0; an uncaught
    exception: its traceback, 1) without interpreter teardown. torch 2.11's gloo worker threads
    can drop the last reference to a tensor that has a Python object after the main thread has
    begun finalizing; taking the GIL then ends the thread with pthread_exit through a noexcept
    frame, and the process aborts ("terminate called without an active exception") after all
    work and destroy_process_group are done (pytorch/pytorch#179291 describes it; the stack
    seen here: ProcessGroupGloo::runLoop -> ~TensorImpl -> decref_pyobject ->
    PyEval_AcquireThread -> pthread_exit). The same exit as reshard.train's."""
    import traceback

    try:
        code = main()
        code = code if isinstance(code, int) else 0 if code is None else 1
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed, then the exit code says it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
