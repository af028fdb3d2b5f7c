#include "reshard/io/file_byte_source.h"

#include <string>

#include "reshard/base/error.h"

namespace reshard {

FileByteSource::FileByteSource(const File& file) : file_(file), size_(file.Size()) {}

void FileByteSource::Read(uint64_t offset, size_t size, void* dst) const {
  if (offset > size_ || size > size_ - offset) {
    FailField(Name(), "read", "[" + std::to_string(offset) + ", +" + std::to_string(size) + ")",
              "a range inside the file of " + std::to_string(size_) + " bytes (truncated?)");
  }
  file_.PReadExact(dst, size, offset);
}

const std::string& FileByteSource::Name() const { return file_.path(); }

}  // namespace reshard
