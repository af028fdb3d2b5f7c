// libFuzzer target: the ZIP central directory reader (and, when a directory parses, the local
// headers and the whole torch archive reader on top) must refuse malformed input with a
// reshard::Error and never read outside the buffer, crash or hang.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "reshard/base/error.h"
#include "reshard/format/torch_zip.h"
#include "reshard/format/zip_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  reshard::MemoryByteSource src(bytes, "fuzz.zip");
  try {
    const reshard::ZipDirectory dir = reshard::ReadZipDirectory(src);
    for (const auto& e : dir.entries) {
      try {
        const uint64_t at = reshard::ZipEntryDataOffset(src, dir, e);
        if (at > size || e.size > size - at) __builtin_trap();  // promised to be inside
      } catch (const reshard::Error&) {
      }
    }
  } catch (const reshard::Error&) {
  }
  try {
    const reshard::WeightFile f = reshard::ParseTorchZip(src);
    for (const auto& t : f.tensors) {
      if (t.offset > size || t.nbytes > size - t.offset) __builtin_trap();
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
