# The Python extension's build tools: the interpreter (with development headers) and pybind11.
# The extension uses no torch headers and links no torch library (tensors cross as pointers),
# so torch is not needed to build it: pip's default isolated build (`pip install .`, with
# scikit-build-core and pybind11 from pyproject.toml's build requirements) and
# `pip install --no-build-isolation .` build the same extension. When torch happens to be
# importable by the build's Python (a --no-build-isolation or developer build), its version is
# recorded and its CUDA major version is checked against the toolkit's (ReshardCuda.cmake).
# Sets:
#   RESHARD_TORCH_VERSION        torch.__version__ seen at build time ("" when not importable)
#   RESHARD_TORCH_CUDA_VERSION   its torch.version.cuda ("" for a CPU-only or absent torch)
#   RESHARD_PYTHON_VERSION       "3.11" ("" when the extension is not built)
#   RESHARD_PYBIND11_VERSION     pybind11's version ("" when the extension is not built)
include_guard(GLOBAL)
set(RESHARD_TORCH_VERSION "")
set(RESHARD_TORCH_CUDA_VERSION "")
set(RESHARD_PYTHON_VERSION "")
set(RESHARD_PYBIND11_VERSION "")
if(NOT RESHARD_BUILD_PYTHON)
  return()
endif()

find_package(Python COMPONENTS Interpreter Development.Module)
if(NOT Python_FOUND)
  message(FATAL_ERROR
    "reshard: no Python interpreter with development headers found (needed for the Python "
    "extension reshard._C). Install them (apt-get install python3-dev), pass "
    "-DPython_EXECUTABLE=/path/to/venv/bin/python, or build the C++ parts only with "
    "-DRESHARD_BUILD_PYTHON=OFF.")
endif()
set(RESHARD_PYTHON_VERSION "${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}")

# torch, only to record it and to check the CUDA major version (never required).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import sys, torch; sys.stdout.write(torch.__version__ + ';' + (torch.version.cuda or ''))"
  RESULT_VARIABLE _reshard_torch_rc
  OUTPUT_VARIABLE _reshard_torch_out
  ERROR_QUIET)
if(_reshard_torch_rc EQUAL 0)
  list(GET _reshard_torch_out 0 RESHARD_TORCH_VERSION)
  list(GET _reshard_torch_out 1 RESHARD_TORCH_CUDA_VERSION)
  if(RESHARD_TORCH_CUDA_VERSION STREQUAL "")
    message(STATUS "reshard: torch ${RESHARD_TORCH_VERSION} (CPU-only) importable by "
                   "${Python_EXECUTABLE} (recorded; the extension does not use its headers)")
  else()
    message(STATUS "reshard: torch ${RESHARD_TORCH_VERSION} (CUDA ${RESHARD_TORCH_CUDA_VERSION}) "
                   "importable by ${Python_EXECUTABLE} (recorded; the extension does not use its "
                   "headers)")
  endif()
else()
  message(STATUS "reshard: torch not importable by ${Python_EXECUTABLE} (an isolated build): "
                 "not needed, the extension uses no torch headers")
endif()

find_package(pybind11 CONFIG QUIET)
if(NOT pybind11_FOUND)
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "import pybind11; print(pybind11.get_cmake_dir())"
                  RESULT_VARIABLE _reshard_pb_rc OUTPUT_VARIABLE _reshard_pb_dir
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_reshard_pb_rc EQUAL 0)
    find_package(pybind11 CONFIG QUIET PATHS "${_reshard_pb_dir}" NO_DEFAULT_PATH)
  endif()
endif()
if(NOT pybind11_FOUND)
  message(FATAL_ERROR
    "reshard: pybind11 not found for ${Python_EXECUTABLE}. `pip install .` installs it into its "
    "isolated build environment by itself (pyproject.toml's build requirements); for "
    "`pip install --no-build-isolation .` or a CMake build, install it into that environment "
    "(pip install pybind11) or pass -Dpybind11_DIR=$(python -c 'import pybind11; "
    "print(pybind11.get_cmake_dir())').")
endif()
set(RESHARD_PYBIND11_VERSION "${pybind11_VERSION}")
