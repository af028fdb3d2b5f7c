"""The README's quick start, run verbatim.

Every fenced ```bash block that follows a ``<!-- quickstart -->`` line in README.md is run, in
order, by ``bash -euo pipefail``, in a fresh copy of the repository (its git-tracked and
untracked-but-not-ignored files) inside a temporary directory, with a fresh virtual environment
first on PATH. That environment sees the torch, transformers, accelerate, scikit-build-core and
pybind11 of the interpreter running pytest (a .pth file, and a ``torchrun`` script; ``pip
install torch ...`` then finds them installed and downloads nothing), the way a user's training environment already holds
torch; ``pip install .`` builds (in pip's isolated build environment, whose build requirements
pip downloads) and installs reshard into it for real.
PYTHONPATH and RESHARD_BIN are removed, so the commands can only use the installed ``reshard``
command and package.

The ``<!-- quickstart-system ... -->`` block (apt-get) is not run; its packages must be
installed (dpkg), which scripts/setup.sh does on CI.

About 2-5 minutes on 2 cores, nearly all of it compiling reshard.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCE = re.compile(r"^<!-- (quickstart[-a-z]*)[^>]*-->\n```bash\n(.*?)^```", re.M | re.S)


def blocks(kind: str) -> List[str]:
    found = [body for k, body in FENCE.findall(README.read_text()) if k == kind]
    assert found, f"README.md has no ```bash block marked <!-- {kind} -->"
    return found


def cmake_version() -> str:
    m = re.search(r"project\(reshard VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert m, "CMakeLists.txt: project(reshard VERSION ...) not found"
    return m.group(1)


def copy_repo(dst: Path) -> None:
    try:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                                "--exclude-standard"], check=True, capture_output=True,
                               text=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            "build*", ".venv", ".work", "__pycache__", "_C*.so", ".git"))
        return
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def make_venv(path: Path) -> Path:
    """A venv whose site-packages also holds this interpreter's (torch & co.) via a .pth."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "_reshard_test_parent_env.pth").write_text("".join(p + "\n" for p in sorted(parents)))
    # torch's console script, as pip writes it into an environment that holds torch (the
    # parent's own torchrun would start the parent's interpreter, which lacks reshard).
    torchrun = path / "bin" / "torchrun"
    torchrun.write_text(f"#!{py}\nimport sys\nfrom torch.distributed.run import main\n"
                        "sys.exit(main())\n")
    torchrun.chmod(0o755)
    return path


def test_readme_system_packages_are_installed():
    (block,) = blocks("quickstart-system")
    m = re.search(r"apt-get install -y (.+)", block)
    assert m, f"no apt-get install line in the quickstart-system block:\n{block}"
    packages = m.group(1).split()
    assert {"libzstd-dev", "libxxhash-dev", "nlohmann-json3-dev", "libcli11-dev"} <= set(packages)
    if shutil.which("dpkg-query") is None:
        pytest.fail("dpkg-query not found: this check needs a Debian/Ubuntu machine", pytrace=False)
    p = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *packages],
                       capture_output=True, text=True)
    missing = [line for line in p.stdout.splitlines() if not line.endswith("install ok installed")]
    assert p.returncode == 0 and not missing, (
        f"README's apt-get packages not all installed: {missing or p.stderr}")
    # Every package the README names is one scripts/setup.sh installs (or checks for).
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert all(pkg in setup or pkg in ("g++", "cmake") for pkg in packages), packages


def test_readme_quickstart_runs_verbatim(tmp_path):
    steps = blocks("quickstart")
    # pip's default build isolation: the build requirements come from pyproject.toml.
    assert any(re.search(r"^pip install \.$", b, re.M) for b in steps)
    work = tmp_path / "reshard"
    copy_repo(work)
    venv = make_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RESHARD_BIN", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/bin:/bin")])
    env["VIRTUAL_ENV"] = str(venv)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    outputs = []
    for i, body in enumerate(steps, 1):
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=work, env=env,
                           capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
        outputs.append(p.stdout + p.stderr)
        assert p.returncode == 0, (
            f"README quickstart block {i} of {len(steps)} failed (exit {p.returncode}):\n"
            f"{body}\n--- stdout ---\n{p.stdout[-6000:]}\n--- stderr ---\n{p.stderr[-6000:]}")

    # The commands used what pip installed, not the repository's build.
    reshard_cli = shutil.which("reshard", path=env["PATH"])
    assert reshard_cli == str(venv / "bin" / "reshard"), reshard_cli
    version = subprocess.run([reshard_cli, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith(f"reshard {cmake_version()}\n"), version.stdout
    assert re.search(r"^CUDA: (yes \([0-9.]+\)|no \(CPU-only build\))$", version.stdout, re.M)
    info = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import reshard, json; print(json.dumps([reshard.__file__, reshard.__version__, "
         "reshard._C.build_info()]))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    import json
    file, py_version, build_info = json.loads(info.stdout)
    assert Path(file).is_relative_to(venv), f"reshard imported from {file}, not the venv"
    assert py_version == cmake_version() == build_info["version"]
    assert build_info["version_text"] == version.stdout.rstrip("\n")
    # The training step loaded and checked the weights, and trained.
    train_log = next(o for o, b in zip(outputs, steps) if "reshard.train" in b)
    assert re.search(r"^step 5/5 loss [0-9.]+ ", train_log, re.M), train_log[-3000:]
