// Random access to bytes, for the parsers of untrusted input (zip_reader.h, torch_zip.h):
// they run on memory here, and on files through FileByteSource (reshard/io/file_byte_source.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace reshard {

/// Random access to the bytes of a file or of a buffer, so that parsers can be run (and
/// fuzzed) on memory as well as on files.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t Size() const = 0;
  /// Reads exactly `size` bytes at `offset`. Throws kDataLoss naming Name() when the range
  /// is not inside [0, Size()).
  virtual void Read(uint64_t offset, size_t size, void* dst) const = 0;
  /// The name used in error messages (a path).
  virtual const std::string& Name() const = 0;
};

/// A ByteSource over memory the caller keeps alive.
class MemoryByteSource final : public ByteSource {
 public:
  MemoryByteSource(std::string_view bytes, std::string name)
      : bytes_(bytes), name_(std::move(name)) {}
  uint64_t Size() const override { return bytes_.size(); }
  void Read(uint64_t offset, size_t size, void* dst) const override;
  const std::string& Name() const override { return name_; }

 private:
  std::string_view bytes_;
  std::string name_;
};

}  // namespace reshard
