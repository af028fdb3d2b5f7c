"""The build refuses clearly what it cannot build with (configure step only, a few seconds each).

* no torch importable by the build's Python → CMake FATAL_ERROR saying to install torch and
  use ``pip install --no-build-isolation .`` (what pip's default isolated build hits);
* a compiler without C++20 → FATAL_ERROR naming the compiler and what to install.

The successful paths are tested elsewhere: ``pip install --no-build-isolation .`` by
test_readme.py, ``cmake --install`` + ``find_package(reshard)`` by the CTest install_consumer.
"""

from __future__ import annotations

import os
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


def test_refuses_without_torch(tmp_path):
    # A fresh venv of the same interpreter, without system site-packages: no torch in it.
    venv = tmp_path / "venv-no-torch"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    probe = subprocess.run([str(py), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "the bare venv can import torch; the test would prove nothing"
    r = configure(tmp_path / "build", f"-DPython_EXECUTABLE={py}", "-DRESHARD_BUILD_TESTS=OFF")
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert "reshard: torch is not importable by the build's Python" in text, text
    assert "pip install --no-build-isolation ." in text, text
    assert "No module named 'torch'" in text, text


def test_cxx_only_build_needs_no_torch(tmp_path):
    venv = tmp_path / "venv-no-torch"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = configure(tmp_path / "build", f"-DPython_EXECUTABLE={venv / 'bin' / 'python'}",
                  "-DRESHARD_BUILD_TESTS=OFF", "-DRESHARD_BUILD_PYTHON=OFF")
    assert r.returncode == 0, r.stdout + r.stderr
    config = (tmp_path / "build" / "generated" / "include" / "reshard" / "base"
              / "build_config.h").read_text()
    assert '#define RESHARD_BUILD_TORCH_VERSION ""' in config, config


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
