"""The hostile-file corpus tests/golden/ through the CLI: for every case of
tests/golden/expectations.json (tests/golden/make_golden.py), each listed command (`inspect`,
`verify`, `convert`) exits with the listed code and prints the listed message (file, field,
found, expected), within a 4 GiB address-space limit and a time limit: a broken file may not
make reshard crash, hang or allocate without bound. tests/core/golden_test.cc replays the same
table through the core library (also under ASan+UBSan)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
AS_LIMIT = 4 << 30


def _cases():
    table = json.loads((GOLDEN / "expectations.json").read_text())
    for c in table["cases"]:
        for run in c["cli"]:
            yield pytest.param(c, run, id=f"{c['file']}-{run['args'][0]}")


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def test_table_is_substantial():
    table = json.loads((GOLDEN / "expectations.json").read_text())
    assert len(table["cases"]) >= 50
    assert sum(len(c["cli"]) for c in table["cases"]) >= 80


@pytest.mark.parametrize("case,run", list(_cases()))
def test_cli_refuses_golden_file(reshard_bin, tmp_path, case, run):
    path = GOLDEN / case["file"]
    assert path.exists(), path
    args = [a.replace("{path}", str(path)).replace("{tmp}", str(tmp_path)) for a in run["args"]]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([reshard_bin, *args], capture_output=True, timeout=60, env=env,
                       stdin=subprocess.DEVNULL, preexec_fn=_limit)
    out = p.stdout.decode("utf-8", "replace")
    err = p.stderr.decode("utf-8", "replace")
    what = f"{case['what']}\n$ reshard {' '.join(args)}\nexit {p.returncode}\n{out}\n{err}"
    assert p.returncode == run["exit"], what
    for stream, text in (("stdout", out), ("stderr", err)):
        for needle in run.get(stream, []):
            assert needle in text, f"{stream} lacks {needle!r}\n{what}"
    if run["exit"] == 3:
        assert err.startswith("reshard: error: "), what
    if args[0] == "convert":
        # Nothing half-written is left that could be mistaken for output.
        assert not list(tmp_path.glob("out/*/rank-*.reshard")), what
