#include "reshard/format/zip_reader.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <string>

#include "reshard/base/error.h"

namespace reshard {

namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralHeaderSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint64_t kEocdSize = 22;
constexpr uint64_t kZip64LocatorSize = 20;
constexpr uint64_t kZip64EocdSize = 56;
constexpr uint64_t kCentralHeaderSize = 46;
constexpr uint64_t kLocalHeaderSize = 30;
constexpr uint64_t kMaxComment = 0xFFFF;

uint64_t Le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string Quoted(std::string_view name) { return "\"" + Printable(name) + "\""; }

}  // namespace

const ZipEntry* ZipDirectory::Find(std::string_view name) const {
  auto it = by_name.find(std::string(name));
  return it == by_name.end() ? nullptr : &entries[it->second];
}

ZipDirectory ReadZipDirectory(const ByteSource& src) {
  const std::string& path = src.Name();
  const uint64_t size = src.Size();
  if (size < kEocdSize) {
    FailField(path, "ZIP archive", "a file of " + std::to_string(size) + " bytes",
              "at least 22 bytes (an end-of-central-directory record)");
  }
  // 1. End of central directory: the last 22 + comment bytes, comment length matching.
  const uint64_t tail_size = std::min<uint64_t>(size, kEocdSize + kMaxComment);
  const uint64_t tail_start = size - tail_size;
  std::string tail(tail_size, '\0');
  src.Read(tail_start, tail_size, tail.data());
  const auto* t = reinterpret_cast<const uint8_t*>(tail.data());
  int64_t found = -1;
  for (int64_t i = static_cast<int64_t>(tail_size - kEocdSize); i >= 0; --i) {
    if (Le(t + i, 4) == kEocdSig && Le(t + i + 20, 2) == tail_size - i - kEocdSize) {
      found = i;
      break;
    }
  }
  if (found < 0) {
    FailField(path, "end of central directory",
              "no record in the last " + std::to_string(tail_size) + " bytes",
              "a ZIP end-of-central-directory record (PK\\x05\\x06) at the end of the file "
              "(truncated file, or not a ZIP archive)");
  }
  const uint64_t eocd_pos = tail_start + static_cast<uint64_t>(found);
  const uint8_t* e = t + found;
  uint64_t disk = Le(e + 4, 2), cd_disk = Le(e + 6, 2);
  uint64_t entries_disk = Le(e + 8, 2), entries = Le(e + 10, 2);
  uint64_t cd_size = Le(e + 12, 4), cd_offset = Le(e + 16, 4);

  ZipDirectory dir;
  uint64_t cd_limit = eocd_pos;  // the central directory ends before this
  const bool sentinel = disk == 0xFFFF || cd_disk == 0xFFFF || entries_disk == 0xFFFF ||
                        entries == 0xFFFF || cd_size == 0xFFFFFFFF || cd_offset == 0xFFFFFFFF;
  bool has_locator = false;
  if (eocd_pos >= kZip64LocatorSize) {
    uint8_t loc[kZip64LocatorSize];
    src.Read(eocd_pos - kZip64LocatorSize, kZip64LocatorSize, loc);
    if (Le(loc, 4) == kZip64LocatorSig) {
      has_locator = true;
      const uint64_t loc_pos = eocd_pos - kZip64LocatorSize;
      const uint64_t eocd64_disk = Le(loc + 4, 4);
      const uint64_t eocd64_pos = Le(loc + 8, 8);
      const uint64_t disks = Le(loc + 16, 4);
      if (eocd64_disk != 0 || disks > 1) {
        Fail(ErrorCode::kUnsupported,
             path + ": ZIP64 locator: a multi-disk archive (" + std::to_string(disks) +
                 " disks); torch checkpoints are single files");
      }
      if (eocd64_pos > loc_pos || loc_pos - eocd64_pos < kZip64EocdSize) {
        FailField(path, "ZIP64 locator", "end-of-central-directory offset " +
                                             std::to_string(eocd64_pos),
                  "an offset at least 56 bytes before the locator at " + std::to_string(loc_pos));
      }
      uint8_t r[kZip64EocdSize];
      src.Read(eocd64_pos, kZip64EocdSize, r);
      if (Le(r, 4) != kZip64EocdSig) {
        FailField(path, "ZIP64 end of central directory", "signature " + Hex(Le(r, 4)),
                  "0x6064b50 at offset " + std::to_string(eocd64_pos));
      }
      const uint64_t rec_size = Le(r + 4, 8);
      if (rec_size < kZip64EocdSize - 12 || rec_size > loc_pos - eocd64_pos - 12) {
        FailField(path, "ZIP64 end of central directory", "record size " + std::to_string(rec_size),
                  "44 to " + std::to_string(loc_pos - eocd64_pos - 12) +
                      " (the record ends before the locator)");
      }
      const uint64_t d64 = Le(r + 16, 4), cd_disk64 = Le(r + 20, 4);
      const uint64_t ed64 = Le(r + 24, 8), e64 = Le(r + 32, 8);
      const uint64_t size64 = Le(r + 40, 8), off64 = Le(r + 48, 8);
      auto agree = [&](uint64_t v32, uint64_t sentinel_value, uint64_t v64, const char* field) {
        if (v32 != sentinel_value && v32 != v64) {
          FailField(path, std::string("end of central directory: ") + field,
                    std::to_string(v32) + " (ZIP64 record: " + std::to_string(v64) + ")",
                    "the ZIP64 record's value or the ZIP64 marker");
        }
      };
      agree(disk, 0xFFFF, d64, "disk number");
      agree(cd_disk, 0xFFFF, cd_disk64, "central directory disk");
      agree(entries_disk, 0xFFFF, ed64, "entries on this disk");
      agree(entries, 0xFFFF, e64, "entries");
      agree(cd_size, 0xFFFFFFFF, size64, "central directory size");
      agree(cd_offset, 0xFFFFFFFF, off64, "central directory offset");
      disk = d64;
      cd_disk = cd_disk64;
      entries_disk = ed64;
      entries = e64;
      cd_size = size64;
      cd_offset = off64;
      cd_limit = eocd64_pos;
      dir.zip64 = true;
    }
  }
  if (sentinel && !has_locator) {
    FailField(path, "end of central directory", "ZIP64 markers (0xffff / 0xffffffff)",
              "a ZIP64 end-of-central-directory locator before the record");
  }
  if (disk != 0 || cd_disk != 0 || entries_disk != entries) {
    Fail(ErrorCode::kUnsupported, path + ": end of central directory: a multi-disk archive "
                                         "(disk " + std::to_string(disk) + ", central directory "
                                         "on disk " + std::to_string(cd_disk) +
                                         "); torch checkpoints are single files");
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset) {
    FailField(path, "central directory",
              "[" + std::to_string(cd_offset) + ", +" + std::to_string(cd_size) + ")",
              "a range ending before the end-of-central-directory record at " +
                  std::to_string(cd_limit) + " (truncated or malformed archive)");
  }
  if (cd_size > kZipMaxCentralDirectory) {
    FailField(path, "central directory size", std::to_string(cd_size) + " bytes",
              "at most " + std::to_string(kZipMaxCentralDirectory));
  }
  if (entries > cd_size / kCentralHeaderSize) {
    FailField(path, "end of central directory: entries", std::to_string(entries),
              "at most " + std::to_string(cd_size / kCentralHeaderSize) + " (46 bytes each in a " +
                  std::to_string(cd_size) + "-byte central directory)");
  }
  dir.cd_offset = cd_offset;
  dir.cd_size = cd_size;

  // 2. The central directory itself.
  std::string cd(cd_size, '\0');
  src.Read(cd_offset, cd_size, cd.data());
  const auto* c = reinterpret_cast<const uint8_t*>(cd.data());
  uint64_t q = 0;
  dir.entries.reserve(entries);
  for (uint64_t i = 0; i < entries; ++i) {
    const std::string where = "central directory entry " + std::to_string(i);
    if (cd_size - q < kCentralHeaderSize) {
      FailField(path, where, "the directory ending at byte " + std::to_string(q),
                "a 46-byte entry header (" + std::to_string(entries) + " entries announced)");
    }
    const uint8_t* h = c + q;
    if (Le(h, 4) != kCentralHeaderSig) {
      FailField(path, where, "signature " + Hex(Le(h, 4)), "0x2014b50 (PK\\x01\\x02)");
    }
    ZipEntry z;
    z.flags = static_cast<uint16_t>(Le(h + 8, 2));
    z.method = static_cast<uint16_t>(Le(h + 10, 2));
    z.crc32 = static_cast<uint32_t>(Le(h + 16, 4));
    uint64_t csize = Le(h + 20, 4), usize = Le(h + 24, 4);
    const uint64_t name_len = Le(h + 28, 2), extra_len = Le(h + 30, 2), comment_len = Le(h + 32, 2);
    uint64_t disk_start = Le(h + 34, 2);
    uint64_t lho = Le(h + 42, 4);
    const uint64_t var = name_len + extra_len + comment_len;
    if (cd_size - q - kCentralHeaderSize < var) {
      FailField(path, where,
                "name, extra field and comment of " + std::to_string(var) + " bytes",
                "fields inside the central directory (" +
                    std::to_string(cd_size - q - kCentralHeaderSize) + " bytes left)");
    }
    z.name.assign(reinterpret_cast<const char*>(h + kCentralHeaderSize), name_len);
    const std::string entry_where = where + " (" + Quoted(z.name) + ")";
    if (z.name.empty()) FailField(path, where, "an empty name", "a record name");
    // ZIP64 extended information: the 8-byte values of the fields that hold the marker.
    const uint8_t* x = h + kCentralHeaderSize + name_len;
    const bool need64 = usize == 0xFFFFFFFF || csize == 0xFFFFFFFF || lho == 0xFFFFFFFF ||
                        disk_start == 0xFFFF;
    bool got64 = false;
    for (uint64_t k = 0; k < extra_len;) {
      if (extra_len - k < 4) {
        FailField(path, entry_where + ": extra field",
                  std::to_string(extra_len - k) + " stray bytes at its end",
                  "blocks of a 4-byte header and their data");
      }
      const uint64_t id = Le(x + k, 2), len = Le(x + k + 2, 2);
      if (extra_len - k - 4 < len) {
        FailField(path, entry_where + ": extra field",
                  "block " + Hex(id) + " of " + std::to_string(len) + " bytes",
                  "a block inside the extra field (" + std::to_string(extra_len - k - 4) +
                      " bytes left)");
      }
      if (id == 0x0001 && !got64) {
        got64 = true;
        const uint8_t* d = x + k + 4;
        uint64_t used = 0;
        auto take = [&](uint64_t& field, int bytes, const char* what) {
          if (len - used < static_cast<uint64_t>(bytes)) {
            FailField(path, entry_where + ": ZIP64 extra field",
                      std::to_string(len) + " bytes, too short for the " + what,
                      "one 8-byte value per field marked 0xffffffff");
          }
          field = Le(d + used, bytes);
          used += bytes;
        };
        if (usize == 0xFFFFFFFF) take(usize, 8, "uncompressed size");
        if (csize == 0xFFFFFFFF) take(csize, 8, "compressed size");
        if (lho == 0xFFFFFFFF) take(lho, 8, "local header offset");
        if (disk_start == 0xFFFF) take(disk_start, 4, "disk number");
      }
      k += 4 + len;
    }
    if (need64 && !got64) {
      FailField(path, entry_where, "ZIP64 markers (0xffffffff) without a ZIP64 extra field",
                "a ZIP64 extended information block (0x0001)");
    }
    if (z.flags & 0x0041) {
      Fail(ErrorCode::kUnsupported, path + ": " + entry_where +
                                        ": the record is encrypted; torch checkpoints never are");
    }
    if (z.method != 0) {
      Fail(ErrorCode::kUnsupported,
           path + ": " + entry_where + ": compression method " + std::to_string(z.method) +
               (z.method == 8 ? " (deflate)" : "") +
               "; torch.save stores every record uncompressed (method 0), so this archive was "
               "rewritten by another tool: re-save it with torch.save");
    }
    if (disk_start != 0) {
      Fail(ErrorCode::kUnsupported, path + ": " + entry_where + ": on disk " +
                                        std::to_string(disk_start) + " of a multi-disk archive");
    }
    if (csize != usize) {
      FailField(path, entry_where + ": sizes",
                "compressed " + std::to_string(csize) + ", uncompressed " + std::to_string(usize),
                "equal sizes for a stored record");
    }
    z.size = usize;
    z.local_header_offset = lho;
    if (lho > cd_offset || cd_offset - lho < kLocalHeaderSize + name_len ||
        cd_offset - lho - kLocalHeaderSize - name_len < z.size) {
      FailField(path, entry_where + ": local header offset",
                std::to_string(lho) + " for " + std::to_string(z.size) + " bytes of data",
                "a local header and data before the central directory at " +
                    std::to_string(cd_offset));
    }
    if (!dir.by_name.emplace(z.name, dir.entries.size()).second) {
      FailField(path, entry_where, "a second record of this name", "unique record names");
    }
    dir.entries.push_back(std::move(z));
    q += kCentralHeaderSize + var;
  }
  if (q != cd_size) {
    FailField(path, "central directory",
              std::to_string(cd_size - q) + " bytes after the " + std::to_string(entries) +
                  " announced entries",
              "entries filling the central directory exactly");
  }
  return dir;
}

uint64_t ZipEntryDataOffset(const ByteSource& src, const ZipDirectory& dir, const ZipEntry& z) {
  const std::string& path = src.Name();
  const std::string where = "record " + Quoted(z.name);
  uint8_t h[kLocalHeaderSize];
  if (z.local_header_offset > dir.cd_offset ||
      dir.cd_offset - z.local_header_offset < kLocalHeaderSize) {
    FailField(path, where + ": local header", "offset " + std::to_string(z.local_header_offset),
              "a 30-byte header before the central directory at " +
                  std::to_string(dir.cd_offset));
  }
  src.Read(z.local_header_offset, kLocalHeaderSize, h);
  if (Le(h, 4) != kLocalHeaderSig) {
    FailField(path, where + ": local header",
              "signature " + Hex(Le(h, 4)) + " at offset " + std::to_string(z.local_header_offset),
              "0x4034b50 (PK\\x03\\x04)");
  }
  const uint64_t method = Le(h + 8, 2);
  if (method != z.method) {
    FailField(path, where + ": local header: method", std::to_string(method),
              std::to_string(z.method) + " (as in the central directory)");
  }
  const uint64_t name_len = Le(h + 26, 2), extra_len = Le(h + 28, 2);
  const uint64_t data = z.local_header_offset + kLocalHeaderSize + name_len + extra_len;
  if (data > dir.cd_offset || dir.cd_offset - data < z.size) {
    FailField(path, where + ": data",
              "[" + std::to_string(data) + ", +" + std::to_string(z.size) + ")",
              "a range before the central directory at " + std::to_string(dir.cd_offset) +
                  " (truncated or malformed archive)");
  }
  std::string name(name_len, '\0');
  src.Read(z.local_header_offset + kLocalHeaderSize, name_len, name.data());
  if (name != z.name) {
    FailField(path, where + ": local header: name", Quoted(name),
              Quoted(z.name) + " (as in the central directory)");
  }
  return data;
}

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  // Slicing by 8: table[k][b] is the CRC of byte b followed by k zero bytes, so eight bytes
  // are folded in with eight lookups (verify --source checks whole storage records with it).
  static const auto table = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (; size >= 8; p += 8, size -= 8) {
    const uint32_t lo = (uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 |
                         uint32_t{p[3]} << 24) ^ crc;
    crc = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^
          table[4][lo >> 24] ^ table[3][p[4]] ^ table[2][p[5]] ^ table[1][p[6]] ^ table[0][p[7]];
  }
  for (; size > 0; ++p, --size) crc = table[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

}  // namespace reshard
