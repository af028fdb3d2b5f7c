// Validating safetensors headers (the header only; data is read by offset). Read from a file
// by ReadSafetensorsHeader (reshard/io/checkpoint.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"

namespace reshard {

inline constexpr uint64_t kSafetensorsMaxHeaderSize = 100ull * 1000 * 1000;  // as safetensors

struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // absolute byte offset of the data in the file
  uint64_t nbytes = 0;
};

struct SafetensorsFile {
  std::string path;
  uint64_t file_size = 0;
  uint64_t header_size = 0;   // N, the JSON length
  uint64_t header_xxh3 = 0;   // XXH3-64 of the first 8 + N bytes
  uint64_t sample_xxh3 = 0;   // data sample (formats/rank-file.md); set by ReadSafetensorsHeader
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensor> tensors;  // sorted by offset
};

/// Validates an in-memory header. `file_size` is the size of the whole file; `prefix` holds
/// at least the 8-byte length and, if the length is sane, the JSON. Used by the file reader
/// (ReadSafetensorsHeader, reshard/io/checkpoint.h) and by the fuzz target.
SafetensorsFile ParseSafetensorsHeader(std::string_view prefix, uint64_t file_size,
                                       const std::string& path);

}  // namespace reshard
