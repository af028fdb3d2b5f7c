#include "reshard/io/rank_file.h"

#include <algorithm>

#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"

namespace reshard {

std::shared_ptr<const RankFileHeader> HeaderCache::Find(const std::string& path,
                                                        const std::string& header_bytes,
                                                        uint64_t data_size) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(path);
  if (it == entries_.end() || it->second.data_size != data_size || it->second.bytes != header_bytes) {
    return nullptr;
  }
  ++hits_;
  it->second.stamp = ++clock_;
  return it->second.header;
}

void HeaderCache::Put(const std::string& path, std::string header_bytes, uint64_t data_size,
                      std::shared_ptr<const RankFileHeader> header) {
  std::lock_guard<std::mutex> g(mu_);
  const size_t cost = 2 * header_bytes.size();
  if (capacity_ == 0 || cost > max_bytes_) return;
  if (auto it = entries_.find(path); it != entries_.end()) {
    bytes_ -= 2 * it->second.bytes.size();
    entries_.erase(it);
  }
  while (!entries_.empty() && (entries_.size() >= capacity_ || bytes_ + cost > max_bytes_)) EvictLocked();
  entries_[path] = {std::move(header_bytes), data_size, std::move(header), ++clock_};
  bytes_ += cost;
}

void HeaderCache::EvictLocked() {
  auto oldest = entries_.begin();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->second.stamp < oldest->second.stamp) oldest = it;
  }
  bytes_ -= 2 * oldest->second.bytes.size();
  entries_.erase(oldest);
}

size_t HeaderCache::hits() const {
  std::lock_guard<std::mutex> g(mu_);
  return hits_;
}

RankFileReader RankFileReader::Open(const std::filesystem::path& path, HeaderCache* cache) {
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
  if (cache != nullptr) {
    r.header_ = cache->Find(path.string(), header, r.preamble_.data_size);
    if (r.header_) return r;
  }
  r.header_ = std::make_shared<const RankFileHeader>(ParseHeader(header, r.preamble_.data_size, path.string()));
  if (cache != nullptr) cache->Put(path.string(), std::move(header), r.preamble_.data_size, r.header_);
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

uint64_t RankFileReader::ReadChunk(const TensorEntry& t, uint64_t chunk, void* dst, std::string& scratch,
                                   uint64_t hash_piece, const DirectSource& direct) const {
  const uint64_t cs = header_->chunk_size;
  const uint64_t len = ChunkLength(t, cs, chunk);
  const uint64_t base = preamble_.data_offset + t.offset;
  auto read = [&](void* buf, uint64_t n, uint64_t offset) {
    if (direct.file) {
      direct.reader->Read(*direct.file, buf, n, offset);
    } else {
      file_.PReadExact(buf, n, offset);
    }
  };
  uint64_t hash = 0;
  if (t.codec == Codec::kRaw && !direct.file && hash_piece > 0 && hash_piece < len) {
    Xxh3Hasher hasher;
    auto* out = static_cast<char*>(dst);
    for (uint64_t at = 0; at < len; at += hash_piece) {
      const uint64_t n = std::min(hash_piece, len - at);
      read(out + at, n, base + ChunkBegin(cs, chunk) + at);
      hasher.Update(out + at, n);
    }
    hash = hasher.Digest();
  } else if (t.codec == Codec::kRaw) {
    read(dst, len, base + ChunkBegin(cs, chunk));
    hash = Xxh3(dst, len);
  } else {
    const Frame& f = t.frames[chunk];
    scratch.resize(f.size);
    read(scratch.data(), f.size, base + f.offset);
    DecodeZstdFrame(scratch.data(), f.size, dst, len,
                    path() + ": tensor \"" + t.name + "\" chunk " + std::to_string(chunk));
    hash = Xxh3(dst, len);
  }
  CheckChunk(t, chunk, hash);
  return len;
}

void RankFileReader::CheckChunk(const TensorEntry& t, uint64_t chunk, uint64_t hash) const {
  if (hash != t.chunk_xxh3[chunk]) {
    Fail(ErrorCode::kDataLoss, path() + ": tensor \"" + t.name + "\" chunk " + std::to_string(chunk) +
                                   ": checksum mismatch: data hashes to " + Hex16(hash) +
                                   ", header says " + Hex16(t.chunk_xxh3[chunk]) +
                                   " (the file is corrupt)");
  }
}

void RankFileReader::CheckPadding() const {
  std::vector<char> buf(64 << 10);
  // [begin, end) in file offsets must be zero; `where` says what lies around it.
  auto zero = [&](uint64_t begin, uint64_t end, const std::string& where) {
    for (uint64_t at = begin; at < end;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(end - at, buf.size()));
      file_.PReadExact(buf.data(), n, at);
      for (size_t k = 0; k < n; ++k) {
        if (buf[k] != 0) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", static_cast<unsigned char>(buf[k]));
          Fail(ErrorCode::kDataLoss,
               path() + ": padding byte at file offset " + std::to_string(at + k) + " (" +
                   where + ") is " + hex + ", expected 0 (formats/rank-file.md: padding is "
                   "zero); the file was altered after it was written");
        }
      }
      at += n;
    }
  };
  zero(kPreambleSize, preamble_.data_offset, "between the preamble and the data region");
  const uint64_t base = preamble_.data_offset;
  uint64_t end = 0;  // in the data region
  std::string after = "the start of the data region";
  for (const TensorEntry& t : header_->tensors) {
    if (t.offset > end) zero(base + end, base + t.offset, "after " + after);
    if (t.offset + t.stored_size > end) {
      end = t.offset + t.stored_size;
      after = "tensor \"" + Printable(t.name) + "\"";
    }
  }
  zero(base + end, base + preamble_.data_size, "after " + after + ", up to the header");
}

void RankFileReader::ReadTensor(const TensorEntry& t, void* dst) const {
  std::string scratch;
  auto* out = static_cast<char*>(dst);
  const uint64_t cs = header_->chunk_size;
  for (uint64_t c = 0; c < t.ChunkCount(cs); ++c) {
    ReadChunk(t, c, out + ChunkBegin(cs, c), scratch);
  }
}

}  // namespace reshard
