# Whether to build the CUDA copy engine (reshard::cuda, used by the Python extension).
# Default: on when a CUDA toolkit is found whose major version equals the major version of
# torch's torch.version.cuda (the extension's CUDA runtime then needs no newer driver than torch
# does); off with a CPU-only torch or a toolkit of another major version. Without the Python
# extension (-DRESHARD_BUILD_PYTHON=OFF): on whenever a toolkit is found.
# -DRESHARD_WITH_CUDA=ON/OFF overrides (ON with a mismatched toolkit builds, with a warning).
include_guard(GLOBAL)
find_package(CUDAToolkit QUIET)
set(_reshard_cuda_default OFF)
if(NOT CUDAToolkit_FOUND)
  set(_reshard_cuda_why "no CUDA toolkit found")
elseif(NOT RESHARD_BUILD_PYTHON)
  set(_reshard_cuda_default ON)
  set(_reshard_cuda_why "CUDA toolkit ${CUDAToolkit_VERSION} found")
elseif(RESHARD_TORCH_CUDA_VERSION STREQUAL "")
  set(_reshard_cuda_why "torch ${RESHARD_TORCH_VERSION} is a CPU-only build")
else()
  string(REGEX MATCH "^[0-9]+" _reshard_torch_cuda_major "${RESHARD_TORCH_CUDA_VERSION}")
  if(CUDAToolkit_VERSION_MAJOR STREQUAL _reshard_torch_cuda_major)
    set(_reshard_cuda_default ON)
    set(_reshard_cuda_why "CUDA toolkit ${CUDAToolkit_VERSION} matches torch's CUDA "
                          "${RESHARD_TORCH_CUDA_VERSION}")
  else()
    set(_reshard_cuda_why "the CUDA toolkit found (${CUDAToolkit_VERSION}, "
                          "${CUDAToolkit_BIN_DIR}) is not of torch's CUDA major version "
                          "(${RESHARD_TORCH_CUDA_VERSION}); install CUDA toolkit "
                          "${_reshard_torch_cuda_major}.x and point CUDAToolkit_ROOT at it for a "
                          "CUDA build")
  endif()
endif()
string(CONCAT _reshard_cuda_why ${_reshard_cuda_why})
option(RESHARD_WITH_CUDA "Build the CUDA copy engine" ${_reshard_cuda_default})
if(RESHARD_WITH_CUDA AND NOT _reshard_cuda_default)
  if(NOT CUDAToolkit_FOUND)
    message(FATAL_ERROR "reshard: RESHARD_WITH_CUDA=ON but no CUDA toolkit was found "
                        "(set CUDAToolkit_ROOT, or -DRESHARD_WITH_CUDA=OFF for a CPU-only build).")
  endif()
  message(WARNING "reshard: RESHARD_WITH_CUDA=ON as asked, although ${_reshard_cuda_why}; "
                  "the copy engine may then need a newer driver than torch does.")
endif()
if(RESHARD_WITH_CUDA)
  message(STATUS "reshard: CUDA copy engine ON (${_reshard_cuda_why})")
else()
  message(STATUS "reshard: CPU-only build, CUDA copy engine OFF (${_reshard_cuda_why})")
endif()
set(RESHARD_CUDA_VERSION "")
if(RESHARD_WITH_CUDA)
  set(RESHARD_CUDA_VERSION "${CUDAToolkit_VERSION}")
endif()
