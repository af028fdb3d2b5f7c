#include "reshard/rank_file.h"

#include <zstd.h>

#include <vector>

#include "reshard/checksum.h"
#include "reshard/error.h"

namespace reshard {

RankFileReader RankFileReader::Open(const std::filesystem::path& path) {
  RankFileReader r;
  r.file_ = File::OpenRead(path);
  r.file_size_ = r.file_.Size();
  uint8_t pre[kPreambleSize] = {};
  const size_t got = r.file_.PReadUpTo(pre, kPreambleSize, 0);
  r.preamble_ = DecodePreamble(pre, got < kPreambleSize ? got : r.file_size_, path.string());
  std::string header(r.preamble_.header_size, '\0');
  r.file_.PReadExact(header.data(), header.size(), r.preamble_.header_offset);
  const uint64_t hash = Xxh3(header);
  if (hash != r.preamble_.header_xxh3) {
    FailField(path.string(), "header_xxh3", Hex16(r.preamble_.header_xxh3),
              Hex16(hash) + " (the header is corrupt)");
  }
  r.header_ = ParseHeader(header, r.preamble_.data_size, path.string());
  return r;
}

void DecodeZstdFrame(const void* src, size_t src_size, void* dst, size_t expected,
                     const std::string& what) {
  const unsigned long long content = ZSTD_getFrameContentSize(src, src_size);
  if (content == ZSTD_CONTENTSIZE_ERROR || content != expected) {
    Fail(ErrorCode::kDataLoss,
         what + ": zstd frame declares " +
             (content == ZSTD_CONTENTSIZE_ERROR ? std::string("no valid size")
                                                : std::to_string(content) + " bytes") +
             ", expected " + std::to_string(expected));
  }
  const size_t n = ZSTD_decompress(dst, expected, src, src_size);
  if (ZSTD_isError(n) || n != expected) {
    Fail(ErrorCode::kDataLoss, what + ": zstd frame does not decode (" +
                                   (ZSTD_isError(n) ? std::string(ZSTD_getErrorName(n))
                                                    : std::to_string(n) + " bytes") +
                                   ")");
  }
}

uint64_t RankFileReader::ReadChunk(const TensorEntry& t, uint64_t chunk, void* dst,
                                   std::string& scratch) const {
  const uint64_t cs = header_.chunk_size;
  const uint64_t len = ChunkLength(t, cs, chunk);
  const uint64_t base = preamble_.data_offset + t.offset;
  const std::string what =
      path() + ": tensor \"" + t.name + "\" chunk " + std::to_string(chunk);
  if (t.codec == Codec::kRaw) {
    file_.PReadExact(dst, len, base + ChunkBegin(cs, chunk));
  } else {
    const Frame& f = t.frames[chunk];
    scratch.resize(f.size);
    file_.PReadExact(scratch.data(), f.size, base + f.offset);
    DecodeZstdFrame(scratch.data(), f.size, dst, len, what);
  }
  const uint64_t hash = Xxh3(dst, len);
  if (hash != t.chunk_xxh3[chunk]) {
    Fail(ErrorCode::kDataLoss, what + ": checksum mismatch: data hashes to " + Hex16(hash) +
                                   ", header says " + Hex16(t.chunk_xxh3[chunk]) +
                                   " (the file is corrupt)");
  }
  return len;
}

void RankFileReader::ReadTensor(const TensorEntry& t, void* dst) const {
  std::string scratch;
  auto* out = static_cast<char*>(dst);
  const uint64_t cs = header_.chunk_size;
  for (uint64_t c = 0; c < t.ChunkCount(cs); ++c) {
    ReadChunk(t, c, out + ChunkBegin(cs, c), scratch);
  }
}

}  // namespace reshard
