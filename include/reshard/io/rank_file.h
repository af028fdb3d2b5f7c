// Reading rank files: open + validate, then read tensors with checksum verification.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "reshard/format/rank_file_format.h"
#include "reshard/io/file_io.h"

namespace reshard {

/// Headers parsed before, keyed by path and the header's exact bytes: opening a file whose
/// header bytes equal those of an earlier open of the same path reuses that parse (parsing a
/// header's JSON takes 1-3 ms, most of the fixed cost of loading a sub-GB rank file). The
/// bytes are still read and checked against the preamble's checksum on every open.
/// Thread-safe; keeps the `capacity` most recently used paths, and no more than about
/// `max_bytes` of headers (each counted twice its text: the text and its parse).
class HeaderCache {
 public:
  explicit HeaderCache(size_t capacity = 64, size_t max_bytes = size_t{256} << 20)
      : capacity_(capacity), max_bytes_(max_bytes) {}
  std::shared_ptr<const RankFileHeader> Find(const std::string& path, const std::string& header_bytes,
                                             uint64_t data_size);
  void Put(const std::string& path, std::string header_bytes, uint64_t data_size,
           std::shared_ptr<const RankFileHeader> header);
  size_t hits() const;

 private:
  struct Entry {
    std::string bytes;
    uint64_t data_size = 0;
    std::shared_ptr<const RankFileHeader> header;
    uint64_t stamp = 0;  // for eviction: larger = used later
  };
  void EvictLocked();  // the least recently used entry
  size_t capacity_, max_bytes_;
  size_t bytes_ = 0;  // sum of the entries' costs
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
  uint64_t clock_ = 0;
  size_t hits_ = 0;
};

/// Where RankFileReader::ReadChunk reads from instead of the file's page-cached reads: `file`,
/// the same file opened O_DIRECT (File::ReopenDirect), through `reader` (DirectReader: straight
/// into an aligned destination, else through its bounce buffer). For files on disk, where
/// buffered reads fall short of the disk (bench/HISTORY.md §7). Default: none.
struct DirectSource {
  const File* file = nullptr;
  DirectReader* reader = nullptr;
};

class RankFileReader {
 public:
  /// Opens and validates preamble and header (invariants 1–7). Throws kNotFound / kDataLoss.
  /// With a cache, a header whose bytes were parsed before for this path is not parsed again.
  static RankFileReader Open(const std::filesystem::path& path, HeaderCache* cache = nullptr);

  const RankFileHeader& header() const { return *header_; }
  const Preamble& preamble() const { return preamble_; }
  const std::string& path() const { return file_.path(); }
  uint64_t file_size() const { return file_size_; }
  const File& file() const { return file_; }

  /// Reads and decodes chunk `chunk` of `tensor` into `dst` (capacity ≥ chunk length) and
  /// checks its checksum (invariant 8). `scratch` is reused for compressed frames. Returns
  /// the chunk's decoded length. Throws kDataLoss on a checksum mismatch or bad frame.
  /// `hash_piece` > 0: a raw chunk is read in pieces of that many bytes, each hashed right
  /// after it is read, while it is still in the core's cache (not with `direct`: one read).
  uint64_t ReadChunk(const TensorEntry& tensor, uint64_t chunk, void* dst, std::string& scratch,
                     uint64_t hash_piece = 0, const DirectSource& direct = {}) const;

  /// Throws kDataLoss naming this file, the tensor and the chunk unless `hash` (XXH3-64 of
  /// the chunk's decoded bytes) is the header's chunk_xxh3 of it.
  void CheckChunk(const TensorEntry& t, uint64_t chunk, uint64_t hash) const;

  /// Reads a whole tensor into `dst` (tensor.nbytes bytes), verifying every chunk and the
  /// tensor checksum.
  void ReadTensor(const TensorEntry& tensor, void* dst) const;
  /// Checks that every byte the format says is zero padding is zero (formats/rank-file.md):
  /// preamble bytes [64, data_offset), and the data region's bytes outside every tensor's
  /// [offset, offset + stored_size). Throws kDataLoss naming the file, the first nonzero byte's
  /// file offset and value, and where it lies.
  void CheckPadding() const;

 private:
  File file_;
  uint64_t file_size_ = 0;
  Preamble preamble_;
  std::shared_ptr<const RankFileHeader> header_;
};

/// Decompresses one zstd frame into exactly `expected` bytes; kDataLoss otherwise.
void DecodeZstdFrame(const void* src, size_t src_size, void* dst, size_t expected,
                     const std::string& what);

}  // namespace reshard
