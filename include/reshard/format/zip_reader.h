// Reading the central directory of a ZIP archive (the container of torch.save files) without
// reading the records themselves. Only what torch writes is accepted: one disk, STORED
// (uncompressed) records, no encryption; ZIP64 is supported.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "reshard/format/byte_source.h"

namespace reshard {

inline constexpr uint64_t kZipMaxCentralDirectory = 512ull << 20;  // bytes

struct ZipEntry {
  std::string name;
  uint16_t flags = 0;
  uint16_t method = 0;   // 0 = STORED; anything else is refused by ReadZipDirectory
  uint32_t crc32 = 0;
  uint64_t size = 0;     // compressed = uncompressed for STORED records
  uint64_t local_header_offset = 0;
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;  // central directory order
  uint64_t cd_offset = 0;         // where the central directory starts
  uint64_t cd_size = 0;
  bool zip64 = false;
  std::unordered_map<std::string, size_t> by_name;

  const ZipEntry* Find(std::string_view name) const;
};

/// Finds the end-of-central-directory record (and the ZIP64 locator and record when present)
/// in the last 64 KiB of `src`, then reads and validates the whole central directory: entry
/// signatures and lengths, ZIP64 extra fields, sizes and local header offsets inside the
/// archive, unique names. Throws kDataLoss ("<name>: <field>: found ..., expected ...") for a
/// malformed or truncated archive and kUnsupported for valid ZIP features torch never writes
/// (compression, encryption, several disks).
ZipDirectory ReadZipDirectory(const ByteSource& src);

/// Reads the local header of `entry` (checking its signature and that its name and method
/// agree with the central directory) and returns the absolute offset of the entry's data;
/// [offset, offset + entry.size) is checked to lie before the central directory.
uint64_t ZipEntryDataOffset(const ByteSource& src, const ZipDirectory& dir, const ZipEntry& entry);

/// CRC-32 (ISO-HDLC, as ZIP uses), continuing from `crc` (0 to start).
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

}  // namespace reshard
