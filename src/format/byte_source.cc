#include "reshard/format/byte_source.h"

#include <cstring>
#include <string>

#include "reshard/base/error.h"

namespace reshard {

void MemoryByteSource::Read(uint64_t offset, size_t size, void* dst) const {
  if (offset > bytes_.size() || size > bytes_.size() - offset) {
    FailField(name_, "read", "[" + std::to_string(offset) + ", +" + std::to_string(size) + ")",
              "a range inside the " + std::to_string(bytes_.size()) + " bytes (truncated?)");
  }
  if (size) std::memcpy(dst, bytes_.data() + offset, size);
}

}  // namespace reshard
