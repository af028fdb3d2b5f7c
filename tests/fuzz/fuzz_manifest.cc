// libFuzzer target: the output directory's manifest parser (formats/manifest.md).
// ParseManifest must refuse malformed input with a reshard::Error; what it accepts keeps the
// manifest's invariants (layout keys usable as directory names, ranks sorted and below the
// world size, `complete` true exactly when every rank is listed).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "reshard/base/error.h"
#include "reshard/format/manifest.h"
#include "reshard/format/rank_file_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "fuzz/reshard.json";
  try {
    const reshard::Manifest m =
        reshard::ParseManifest(std::string_view(reinterpret_cast<const char*>(data), size), path);
    for (const auto& [key, l] : m.layouts) {
      if (key.empty() || key == "." || key == ".." || key.find('/') != std::string::npos ||
          l.dir != key || l.world_size == 0) {
        __builtin_trap();
      }
      for (size_t i = 0; i < l.ranks.size(); ++i) {
        if (l.ranks[i].rank >= l.world_size) __builtin_trap();
        if (i > 0 && l.ranks[i].rank <= l.ranks[i - 1].rank) __builtin_trap();
        if (l.ranks[i].file != reshard::RankFileName(l.ranks[i].rank, l.world_size)) {
          __builtin_trap();
        }
      }
      if (l.complete != (l.ranks.size() == l.world_size)) __builtin_trap();
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
