// What this copy of reshard was built with: the version (reshard/base/version.h), the format
// version, and the libraries and options of the build.
#pragma once

#include <cstdint>
#include <string>

namespace reshard {

/// What this copy of reshard was built with. `reshard --version` prints it and
/// reshard._C.build_info() returns it, so the two always agree.
struct BuildInfo {
  std::string version;         // "0.1.0"
  uint32_t format_version = 0;  // rank-file format version written and read
  bool cuda = false;           // the CUDA copy engine was built
  std::string cuda_version;    // CUDA toolkit version it was built with, "" without CUDA
  std::string zstd_version;    // zstd library linked (ZSTD_versionString())
  std::string xxhash_version;  // xxhash.h compiled in (XXH_INLINE_ALL)
  std::string compiler;        // "GNU 12.2.0"
  std::string build_type;      // CMAKE_BUILD_TYPE
  std::string python_version;  // Python the extension was built for ("3.11"), "" if not built
  std::string pybind11_version;  // pybind11 the extension was built with, "" if not built
  std::string torch_version;   // torch importable at build time (recorded only: no torch
                               // headers are used), "" in isolated and C++-only builds
};
BuildInfo GetBuildInfo();

/// The lines `reshard --version` prints: the version, then one "key: value" line per option.
std::string VersionText();

}  // namespace reshard
