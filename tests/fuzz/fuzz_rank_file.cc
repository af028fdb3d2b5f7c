// libFuzzer target: the rank file's preamble and header (formats/rank-file.md, invariants
// 1-7), checked as RankFileReader::Open checks them, on memory.
//
// Input: the 64-byte preamble followed by the header JSON, i.e. a rank file with its data
// region left out (make_seeds.py cuts real files this way). Each input is checked twice:
//  1. as it is, the data region taken to be as long as the preamble's data_size says, so
//     the preamble's own checks (magic, version, checksum, offsets, file size) are exercised;
//  2. with header_offset, header_size, header_xxh3 and preamble_xxh3 rewritten to match the
//     header that follows, so that mutations of the header JSON and of the remaining preamble
//     fields (version, flags, data_offset, data_size) reach the header parser instead of
//     stopping at a checksum.
// Whatever is accepted must keep the invariants the loader relies on.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/format/rank_file_format.h"

namespace {

uint64_t GetLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void PutLE64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

void CheckAccepted(const reshard::RankFileHeader& h, uint64_t data_size) {
  if (h.world_size == 0 || h.rank >= h.world_size || h.chunk_size == 0) __builtin_trap();
  for (const auto& t : h.tensors) {
    if (t.offset > data_size || t.stored_size > data_size - t.offset) __builtin_trap();
    const uint64_t chunks = t.ChunkCount(h.chunk_size);
    if (t.chunk_xxh3.size() != chunks) __builtin_trap();
    if (t.codec == reshard::Codec::kRaw) {
      if (t.stored_size != t.nbytes || !t.frames.empty()) __builtin_trap();
    } else {
      if (t.frames.size() != chunks) __builtin_trap();
      for (const auto& f : t.frames) {
        if (f.offset > t.stored_size || f.size > t.stored_size - f.offset) __builtin_trap();
      }
    }
    if (t.sharded && (t.rows.start > t.rows.end || t.global_shape.empty() ||
                      t.rows.end > t.global_shape[0])) {
      __builtin_trap();
    }
  }
}

void Check(const uint8_t* preamble, std::string_view header, uint64_t file_size) {
  static const std::string path = "fuzz/rank-00000-of-00001.reshard";
  try {
    const reshard::Preamble p = reshard::DecodePreamble(preamble, file_size, path);
    if (p.header_size != header.size()) return;  // the rest of the file is not in the input
    if (reshard::Xxh3(header.data(), header.size()) != p.header_xxh3) return;  // Open refuses
    CheckAccepted(reshard::ParseHeader(header, p.data_size, path), p.data_size);
  } catch (const reshard::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < reshard::kPreambleSize) {
    Check(data, {}, size);  // a file shorter than the preamble
    return 0;
  }
  const std::string_view header(reinterpret_cast<const char*>(data) + reshard::kPreambleSize,
                                size - reshard::kPreambleSize);
  // 1. As it is: the file is as long as the preamble says, when that is consistent.
  const uint64_t data_offset = GetLE64(data + 16);
  const uint64_t data_size = GetLE64(data + 24);
  uint64_t file_size = UINT64_MAX;
  if (data_offset <= UINT64_MAX - data_size &&
      data_offset + data_size <= UINT64_MAX - header.size()) {
    file_size = data_offset + data_size + header.size();
  }
  Check(data, header, file_size);
  // 2. Repaired: offsets, sizes and checksums made to fit the header that follows.
  uint8_t fixed[reshard::kPreambleSize];
  std::memcpy(fixed, data, sizeof fixed);
  std::memcpy(fixed, reshard::kRankFileMagic.data(), reshard::kRankFileMagic.size());
  if (data_offset <= UINT64_MAX - data_size && file_size != UINT64_MAX) {
    PutLE64(fixed + 32, data_offset + data_size);
    PutLE64(fixed + 40, header.size());
    PutLE64(fixed + 48, reshard::Xxh3(header.data(), header.size()));
    PutLE64(fixed + 56, reshard::Xxh3(fixed, reshard::kPreambleHashedBytes));
    Check(fixed, header, file_size);
  }
  return 0;
}
