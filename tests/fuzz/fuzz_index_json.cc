// libFuzzer target: the index file parser (model.safetensors.index.json and
// pytorch_model.bin.index.json). ParseWeightMap must refuse malformed input with a
// reshard::Error; what it accepts is a non-empty map of plain file names.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "reshard/base/error.h"
#include "reshard/format/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "fuzz/model.safetensors.index.json";
  try {
    const auto map =
        reshard::ParseWeightMap(std::string_view(reinterpret_cast<const char*>(data), size), path);
    if (map.empty()) __builtin_trap();
    for (const auto& [key, file] : map) {
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        __builtin_trap();
      }
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
