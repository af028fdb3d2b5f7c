// The file implementation of ByteSource (reshard/format/byte_source.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "reshard/format/byte_source.h"
#include "reshard/io/file_io.h"

namespace reshard {

/// A ByteSource over an open file (pread; nothing is cached).
class FileByteSource final : public ByteSource {
 public:
  explicit FileByteSource(const File& file);
  uint64_t Size() const override { return size_; }
  void Read(uint64_t offset, size_t size, void* dst) const override;
  const std::string& Name() const override;

 private:
  const File& file_;
  uint64_t size_;
};

}  // namespace reshard
