# The torch already installed in the build's Python environment: reshard's Python extension is
# built for it (never for a torch downloaded into an isolated build environment), and its CUDA
# copy engine is built only when a CUDA toolkit of the same major version as torch's
# torch.version.cuda is found. Sets:
#   RESHARD_TORCH_VERSION        torch.__version__ ("" when the Python extension is not built)
#   RESHARD_TORCH_CUDA_VERSION   torch.version.cuda ("" for a CPU-only torch)
include_guard(GLOBAL)
set(RESHARD_TORCH_VERSION "")
set(RESHARD_TORCH_CUDA_VERSION "")
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

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import sys, torch; sys.stdout.write(torch.__version__ + ';' + (torch.version.cuda or ''))"
  RESULT_VARIABLE _reshard_torch_rc
  OUTPUT_VARIABLE _reshard_torch_out
  ERROR_VARIABLE _reshard_torch_err)
if(NOT _reshard_torch_rc EQUAL 0)
  string(STRIP "${_reshard_torch_err}" _reshard_torch_err)
  string(REGEX REPLACE ".*\n" "" _reshard_torch_err "${_reshard_torch_err}")  # last line
  message(FATAL_ERROR
    "reshard: torch is not importable by the build's Python (${Python_EXECUTABLE}): "
    "${_reshard_torch_err}\n"
    "reshard builds against the torch that is already installed in the environment where it "
    "will run; pip's default isolated build environment does not contain it. Install torch "
    "first, then build without build isolation:\n"
    "    pip install torch scikit-build-core pybind11\n"
    "    pip install --no-build-isolation .\n"
    "(To build only the C++ library and CLI: cmake -DRESHARD_BUILD_PYTHON=OFF.)")
endif()
list(GET _reshard_torch_out 0 RESHARD_TORCH_VERSION)
list(GET _reshard_torch_out 1 RESHARD_TORCH_CUDA_VERSION)
if(RESHARD_TORCH_CUDA_VERSION STREQUAL "")
  message(STATUS "reshard: torch ${RESHARD_TORCH_VERSION} (CPU-only) from ${Python_EXECUTABLE}")
else()
  message(STATUS "reshard: torch ${RESHARD_TORCH_VERSION} (CUDA ${RESHARD_TORCH_CUDA_VERSION}) "
                 "from ${Python_EXECUTABLE}")
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
    "reshard: pybind11 not found for ${Python_EXECUTABLE}. Install it into that environment "
    "(pip install pybind11) or pass -Dpybind11_DIR=$(python -c 'import pybind11; "
    "print(pybind11.get_cmake_dir())').")
endif()
