// libFuzzer target: the safetensors header validator. The input is a whole .safetensors file
// (u64 length, JSON header, data); ParseSafetensorsHeader must refuse anything malformed with
// a reshard::Error, and whatever it accepts must describe tensors that lie inside the file,
// sorted, packed and exactly as large as their dtype and shape say.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "reshard/base/dtype.h"
#include "reshard/base/error.h"
#include "reshard/format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "fuzz.safetensors";
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const reshard::SafetensorsFile f = reshard::ParseSafetensorsHeader(bytes, size, path);
    uint64_t at = 8 + f.header_size;
    for (const auto& t : f.tensors) {
      if (t.offset != at || t.offset > size || t.nbytes > size - t.offset) __builtin_trap();
      uint64_t numel = 1;
      for (uint64_t d : t.shape) {
        if (d != 0 && numel > UINT64_MAX / d) __builtin_trap();  // overflow must be refused
        numel *= d;
      }
      const auto n = reshard::BytesFor(t.dtype, numel);
      if (!n || *n != t.nbytes) __builtin_trap();
      at += t.nbytes;
    }
    if (at != size) __builtin_trap();
  } catch (const reshard::Error&) {
  }
  return 0;
}
