"""Shared fixtures of the Python tests.

* ``reshard_bin``: the CLI under test, from $RESHARD_BIN (default /work/main/build/reshard).
  A missing binary is a test error, never a skip.
* ``cli``: runs the CLI and returns a ``CliResult`` (rc, stdout, stderr); ``cli(..., rc=N)``
  also asserts the exit code and shows both streams when it differs; ``cli(..., tty=True)``
  runs it with stdout and stderr on one pseudo-terminal (everything it printed in ``out``).
* ``checkpoint``: ``checkpoint(arch, dtype, sharded, seed=0)`` returns the directory of a tiny
  checkpoint built once per session (tests/python/checkpoints.py). Tests must not modify it;
  copy it first (``tmp_path``) when a test needs to change a source.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))
# reshard.errors (used by the reference reader) is pure Python; make the package importable
# when PYTHONPATH was not set.
try:
    import reshard.errors  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO / "python"))

import checkpoints  # noqa: E402

# `reshard convert` captures the model manifest by running Python (~10 s on 2 cores); off for
# the suite at large, on in the tests of capture (env={"RESHARD_MODEL_CAPTURE": "1"}), with this
# interpreter.
os.environ.setdefault("RESHARD_MODEL_CAPTURE", "0")
os.environ.setdefault("RESHARD_PYTHON", sys.executable)

DEFAULT_BIN = "/work/main/build/reshard"


@dataclass
class CliResult:
    args: Tuple[str, ...]
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def __str__(self) -> str:
        return (f"$ reshard {' '.join(self.args)}\n-> exit {self.rc}\n"
                f"--- stdout ---\n{self.out}--- stderr ---\n{self.err}")


@pytest.fixture(scope="session")
def reshard_bin() -> str:
    path = os.environ.get("RESHARD_BIN", DEFAULT_BIN)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"reshard CLI not found at {path!r}: build it (scripts/setup.sh) and set "
                    f"RESHARD_BIN", pytrace=False)
    return path


def _run_on_tty(cmd, env, timeout) -> Tuple[int, str]:
    """Runs `cmd` with stdout and stderr on a pseudo-terminal; returns (rc, everything). Fails
    when it prints nothing for `timeout` seconds."""
    leader, follower = pty.openpty()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], timeout)
        if not ready:
            p.kill()
            raise AssertionError(f"{cmd} printed nothing for {timeout} s")
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return p.wait(timeout=timeout), b"".join(chunks).decode()


@pytest.fixture(scope="session")
def cli(reshard_bin):
    def run(*args, rc=None, timeout=120, env=None, tty=False) -> CliResult:
        args = tuple(str(a) for a in args)
        full_env = dict(os.environ)
        full_env.setdefault("OMP_NUM_THREADS", "2")
        if env:
            full_env.update(env)
        if tty:
            code, text = _run_on_tty([reshard_bin, *args], full_env, timeout)
            r = CliResult(args, code, text, "")
        else:
            p = subprocess.run([reshard_bin, *args], capture_output=True, text=True,
                               timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
            r = CliResult(args, p.returncode, p.stdout, p.stderr)
        if rc is not None:
            assert r.rc == rc, f"expected exit {rc}\n{r}"
        return r

    return run


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    cache: Dict[tuple, str] = {}
    root = tmp_path_factory.mktemp("checkpoints")

    def get(arch: str, dtype: str = "bf16", sharded: bool = False, seed: int = 0) -> str:
        key = (arch, dtype, bool(sharded), seed)
        if key not in cache:
            path = root / f"{arch}-{dtype}-{'sharded' if sharded else 'single'}-s{seed}"
            cache[key] = checkpoints.make_checkpoint(str(path), arch, dtype, sharded, seed)
        return cache[key]

    return get
