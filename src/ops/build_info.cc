#include "reshard/ops/build_info.h"

#include <xxhash.h>
#include <zstd.h>

#include <string>

#include "reshard/base/version.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {

BuildInfo GetBuildInfo() {
  BuildInfo b;
  b.version = std::string(kVersion);
  b.format_version = kRankFileVersion;
  b.cuda = RESHARD_BUILD_WITH_CUDA != 0;
  b.cuda_version = RESHARD_BUILD_CUDA_VERSION;
  b.zstd_version = ZSTD_versionString();
  b.xxhash_version = std::to_string(XXH_VERSION_MAJOR) + "." + std::to_string(XXH_VERSION_MINOR) +
                     "." + std::to_string(XXH_VERSION_RELEASE);
  b.compiler = RESHARD_BUILD_COMPILER;
  b.build_type = RESHARD_BUILD_TYPE;
  b.python_version = RESHARD_BUILD_PYTHON_VERSION;
  b.pybind11_version = RESHARD_BUILD_PYBIND11_VERSION;
  b.torch_version = RESHARD_BUILD_TORCH_VERSION;
  return b;
}

std::string VersionText() {
  const BuildInfo b = GetBuildInfo();
  std::string t = "reshard " + b.version + "\n";
  t += "rank file format: " + std::to_string(b.format_version) + "\n";
  t += "CUDA: " + (b.cuda ? "yes (" + b.cuda_version + ")" : std::string("no (CPU-only build)")) +
       "\n";
  t += "zstd: " + b.zstd_version + "\n";
  t += "xxhash: " + b.xxhash_version + "\n";
  t += "compiler: " + b.compiler + "\n";
  t += "build type: " + (b.build_type.empty() ? std::string("(none)") : b.build_type) + "\n";
  t += "Python extension: " +
       (b.python_version.empty()
            ? std::string("not built")
            : "Python " + b.python_version + ", pybind11 " + b.pybind11_version +
                  " (no torch headers: works with any torch 2.x" +
                  (b.cuda ? " of CUDA " + b.cuda_version.substr(0, b.cuda_version.find('.')) + ".x"
                          : std::string()) +
                  ")") +
       "\n";
  t += "torch at build time: " +
       (b.torch_version.empty() ? std::string("none (not needed)") : b.torch_version);
  return t;
}
}  // namespace reshard
