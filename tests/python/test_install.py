"""How reshard builds and installs.

Configure step only (a few seconds each):
* no torch importable by the build's Python (what pip's default isolated build sees) → the
  configure succeeds: the extension uses no torch headers; torch is recorded as absent;
* no CUDA toolkit → a CPU-only build (RESHARD_WITH_CUDA defaults OFF); -DRESHARD_WITH_CUDA=OFF
  forces one; =ON without a toolkit is refused;
* a compiler without C++20 → FATAL_ERROR naming the compiler and what to install.

Slow (a full build, minutes): ``pip wheel . --no-deps`` with pip's default build isolation
(build requirements from pyproject.toml, downloaded by pip), the wheel installed into a fresh
venv that sees torch, ``import reshard._C`` and ``reshard --version`` there.
``pip install`` of the README's quick start is run by test_readme.py; ``cmake --install`` +
``find_package(reshard)`` by the CTest install_consumer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def configure(build: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake not on PATH", pytrace=False)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return subprocess.run([cmake, "-S", str(REPO), "-B", str(build), *gen, *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def bare_venv(path: Path) -> Path:
    """A fresh venv of the same interpreter, without system site-packages: no torch in it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    probe = subprocess.run([str(py), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "the bare venv can import torch; the test would prove nothing"
    return py


def build_config(build: Path) -> str:
    return (build / "generated" / "include" / "reshard" / "base" / "build_config.h").read_text()


def pybind11_dir() -> str:
    import pybind11

    return pybind11.get_cmake_dir()


def test_configures_without_torch(tmp_path):
    # What pip's isolated build environment is: Python, pybind11 and scikit-build-core, no torch.
    py = bare_venv(tmp_path / "venv-no-torch")
    r = configure(tmp_path / "build", f"-DPython_EXECUTABLE={py}", f"-Dpybind11_DIR={pybind11_dir()}",
                  "-DRESHARD_BUILD_TESTS=OFF")
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "reshard: torch not importable by" in text and "not needed" in text, text
    config = build_config(tmp_path / "build")
    assert '#define RESHARD_BUILD_TORCH_VERSION ""' in config, config
    assert f'#define RESHARD_BUILD_PYTHON_VERSION "{sys.version_info[0]}.{sys.version_info[1]}"' in config
    assert '#define RESHARD_BUILD_PYBIND11_VERSION ""' not in config, config


def test_cxx_only_build_needs_no_torch(tmp_path):
    py = bare_venv(tmp_path / "venv-no-torch")
    r = configure(tmp_path / "build", f"-DPython_EXECUTABLE={py}",
                  "-DRESHARD_BUILD_TESTS=OFF", "-DRESHARD_BUILD_PYTHON=OFF")
    assert r.returncode == 0, r.stdout + r.stderr
    config = build_config(tmp_path / "build")
    assert '#define RESHARD_BUILD_TORCH_VERSION ""' in config, config
    assert '#define RESHARD_BUILD_PYTHON_VERSION ""' in config, config


def test_cpu_only_build(tmp_path):
    base = ["-DRESHARD_BUILD_TESTS=OFF", "-DRESHARD_BUILD_PYTHON=OFF"]
    # No CUDA toolkit at all (find_package(CUDAToolkit) finds nothing): CPU-only by default.
    r = configure(tmp_path / "b1", *base, "-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON")
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "reshard: CPU-only build, CUDA copy engine OFF (no CUDA toolkit found" in text, text
    assert "#define RESHARD_BUILD_WITH_CUDA 0" in build_config(tmp_path / "b1")
    # ... and asking for CUDA then is refused, saying how to get a CPU-only build.
    r = configure(tmp_path / "b2", *base, "-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON",
                  "-DRESHARD_WITH_CUDA=ON")
    text = r.stdout + r.stderr
    assert r.returncode != 0 and "RESHARD_WITH_CUDA=ON but no CUDA toolkit was found" in text, text
    # The CMake option forces a CPU-only build where a toolkit exists.
    r = configure(tmp_path / "b3", *base, "-DRESHARD_WITH_CUDA=OFF")
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "#define RESHARD_BUILD_WITH_CUDA 0" in build_config(tmp_path / "b3")
    assert '#define RESHARD_BUILD_CUDA_VERSION ""' in build_config(tmp_path / "b3")


def test_cuda_from_the_toolkit_not_from_torch(tmp_path):
    # With a toolkit and no torch (an isolated build), the copy engine is built.
    probe = configure(tmp_path / "probe", "-DRESHARD_BUILD_TESTS=OFF", "-DRESHARD_BUILD_PYTHON=OFF")
    if "CUDA copy engine ON" not in probe.stdout:
        pytest.skip("no CUDA toolkit on this machine")  # covered by test_cpu_only_build then
    py = bare_venv(tmp_path / "venv-no-torch")
    r = configure(tmp_path / "build", f"-DPython_EXECUTABLE={py}", f"-Dpybind11_DIR={pybind11_dir()}",
                  "-DRESHARD_BUILD_TESTS=OFF")
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "reshard: CUDA copy engine ON (CUDA toolkit" in text, text
    assert "#define RESHARD_BUILD_WITH_CUDA 1" in build_config(tmp_path / "build")


def test_refuses_compiler_without_cxx20(tmp_path):
    real = shutil.which("g++") or shutil.which("c++")
    if real is None:
        pytest.fail("no g++/c++ on PATH", pytrace=False)
    # A compiler that behaves like one predating C++20: it rejects -std=c++20 / gnu++20.
    fake = tmp_path / "old-g++"
    fake.write_text("#!/bin/sh\n"
                    "for a in \"$@\"; do case \"$a\" in -std=c++2*|-std=gnu++2*)\n"
                    "  echo \"old-g++: error: unrecognized command-line option '$a'\" >&2; exit 1;;\n"
                    f"esac; done\nexec {real} \"$@\"\n")
    fake.chmod(0o755)
    r = configure(tmp_path / "build", f"-DCMAKE_CXX_COMPILER={fake}", "-DRESHARD_BUILD_PYTHON=OFF",
                  "-DRESHARD_BUILD_TESTS=OFF")
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert "reshard: the C++ compiler" in text and "C++20" in text, text
    assert "GCC >= 11 or Clang >= 14" in text, text


@pytest.mark.slow
def test_wheel_with_build_isolation_installs_elsewhere(tmp_path):
    """pip wheel . with pip's default build isolation (the build requirements come from
    pyproject.toml; torch is not among them), then the wheel installed into a fresh venv
    (which sees this interpreter's torch, as a training environment holds its own)."""
    from test_readme import copy_repo, make_venv

    src = tmp_path / "src"
    copy_repo(src)  # tracked and untracked-but-not-ignored files: no developer build's _C.so
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RESHARD_BIN", "PYTHONHOME", "PIP_NO_BUILD_ISOLATION")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(dist)],
                       cwd=src, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, f"pip wheel failed:\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    (wheel,) = dist.glob("reshard-*.whl")

    venv = make_venv(tmp_path / "venv")
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], env=env,
                   check=True, capture_output=True, text=True, timeout=300)
    info = subprocess.run(
        [str(py), "-c", "import json, reshard, reshard._C as C; "
                        "print(json.dumps([C.__file__, C.build_info(), C.format_bytes(1536)]))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr
    import json

    so, build_info, size = json.loads(info.stdout)
    assert Path(so).is_relative_to(venv), f"reshard._C imported from {so}, not the venv"
    assert size == "1.54 KB"
    # Built without torch: nothing of it was importable in the isolated build environment.
    assert build_info["torch_version"] == "", build_info
    assert build_info["python_version"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    version = subprocess.run([str(venv / "bin" / "reshard"), "--version"], env=env,
                             capture_output=True, text=True, check=True).stdout
    assert version.rstrip("\n") == build_info["version_text"], version
    assert "torch at build time: none (not needed)" in version, version
    assert re.search(r"^CUDA: (yes \([0-9.]+\)|no \(CPU-only build\))$", version, re.M), version


def test_extension_links_no_torch_and_no_cuda_library():
    """Why one wheel serves any torch 2.x: reshard._C needs no torch, c10 or CUDA shared
    library and no symbol of theirs (tensors cross as data pointers; the CUDA runtime is linked
    statically), so the torch a training environment holds is never part of the ABI."""
    import reshard._C as C

    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    if readelf is None or nm is None:
        pytest.fail("binutils (readelf, nm) not on PATH", pytrace=False)
    dyn = subprocess.run([readelf, "-d", C.__file__], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    assert needed and "libc.so.6" in needed, dyn
    foreign = [n for n in needed if re.match(r"lib(torch|c10|cuda|cudart|nccl|shm)", n)]
    assert not foreign, f"reshard._C needs {foreign}"
    undefined = subprocess.run([nm, "-D", "--undefined-only", "-C", C.__file__], capture_output=True,
                               text=True, check=True).stdout
    assert "PyObject" in undefined or "Py_" in undefined, "nm output has no Python symbol: wrong file?"
    torchy = [ln for ln in undefined.splitlines() if re.search(r"\b(at|c10|torch)::", ln)]
    assert not torchy, torchy[:5]
