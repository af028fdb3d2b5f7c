# zstd as the imported target reshard::zstd (used by the build and by reshardConfig.cmake, so
# that the exported reshard::core names no absolute path). Prefers zstd's own CMake package,
# falls back to the header and library found on the system.
include_guard(GLOBAL)
if(NOT TARGET reshard::zstd)
  find_package(zstd CONFIG QUIET)
  if(TARGET zstd::libzstd_shared)
    set(_reshard_zstd_target zstd::libzstd_shared)
  elseif(TARGET zstd::libzstd_static)
    set(_reshard_zstd_target zstd::libzstd_static)
  elseif(TARGET zstd::libzstd)
    set(_reshard_zstd_target zstd::libzstd)
  endif()
  find_path(ZSTD_INCLUDE_DIR zstd.h)
  find_library(ZSTD_LIBRARY NAMES zstd)
  if(NOT ZSTD_INCLUDE_DIR OR (NOT ZSTD_LIBRARY AND NOT _reshard_zstd_target))
    message(FATAL_ERROR "reshard: zstd (header zstd.h and library libzstd) not found. "
                        "Install it: apt-get install libzstd-dev (Debian/Ubuntu), "
                        "dnf install libzstd-devel (Fedora), brew install zstd (macOS), "
                        "or pass -DCMAKE_PREFIX_PATH=<zstd prefix>.")
  endif()
  add_library(reshard::zstd INTERFACE IMPORTED)
  if(_reshard_zstd_target)
    set_target_properties(reshard::zstd PROPERTIES INTERFACE_LINK_LIBRARIES ${_reshard_zstd_target})
  else()
    set_target_properties(reshard::zstd PROPERTIES INTERFACE_LINK_LIBRARIES "${ZSTD_LIBRARY}")
  endif()
  set_target_properties(reshard::zstd PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${ZSTD_INCLUDE_DIR}")
endif()
