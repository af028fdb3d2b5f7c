# Whether to build the CUDA copy engine (reshard::cuda, used by the Python extension).
# The CUDA toolkit decides, not torch: on when a toolkit is found (CUDAToolkit_ROOT, nvcc on
# PATH, /usr/local/cuda), off when none is (a CPU-only build). The copy engine links the CUDA
# runtime statically, so the extension then works beside any torch 2.x built for the same CUDA
# major version, on a driver that supports that toolkit. When torch is importable at build time
# (ReshardPython.cmake) and was built for another CUDA major version, the default is off, with
# the reason (a CPU-only torch does not veto: the wheel may be installed beside a CUDA one).
# -DRESHARD_WITH_CUDA=OFF forces a CPU-only build; =ON with a mismatched toolkit builds, with a
# warning; =ON without a toolkit is an error.
include_guard(GLOBAL)
find_package(CUDAToolkit QUIET)
set(_reshard_cuda_default OFF)
if(NOT CUDAToolkit_FOUND)
  set(_reshard_cuda_why "no CUDA toolkit found; set CUDAToolkit_ROOT for a CUDA build")
elseif(RESHARD_TORCH_CUDA_VERSION STREQUAL "")
  set(_reshard_cuda_default ON)
  set(_reshard_cuda_why "CUDA toolkit ${CUDAToolkit_VERSION} found")
else()
  string(REGEX MATCH "^[0-9]+" _reshard_torch_cuda_major "${RESHARD_TORCH_CUDA_VERSION}")
  if(CUDAToolkit_VERSION_MAJOR STREQUAL _reshard_torch_cuda_major)
    set(_reshard_cuda_default ON)
    set(_reshard_cuda_why "CUDA toolkit ${CUDAToolkit_VERSION} found, of the CUDA major version "
                          "of the importable torch (${RESHARD_TORCH_CUDA_VERSION})")
  else()
    set(_reshard_cuda_why "the CUDA toolkit found (${CUDAToolkit_VERSION}, "
                          "${CUDAToolkit_BIN_DIR}) is not of the importable torch's CUDA major "
                          "version (${RESHARD_TORCH_CUDA_VERSION}); install CUDA toolkit "
                          "${_reshard_torch_cuda_major}.x and point CUDAToolkit_ROOT at it for a "
                          "CUDA build")
  endif()
endif()
string(CONCAT _reshard_cuda_why ${_reshard_cuda_why})
option(RESHARD_WITH_CUDA "Build the CUDA copy engine (default: when a CUDA toolkit is found)"
       ${_reshard_cuda_default})
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
elseif(_reshard_cuda_default)
  message(STATUS "reshard: CPU-only build, CUDA copy engine OFF (-DRESHARD_WITH_CUDA=OFF)")
else()
  message(STATUS "reshard: CPU-only build, CUDA copy engine OFF (${_reshard_cuda_why})")
endif()
set(RESHARD_CUDA_VERSION "")
if(RESHARD_WITH_CUDA)
  set(RESHARD_CUDA_VERSION "${CUDAToolkit_VERSION}")
endif()
