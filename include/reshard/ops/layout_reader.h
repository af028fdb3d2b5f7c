// Reading a layout's rank files as one virtual checkpoint: every tensor the layout describes
// (DescribeLayoutTensors, reshard/plan/layout_tensors.h: the inverse of the byte map, or
// DescribeOptimizerTensors for optimizer state) laid end to end in one virtual file, whose
// bytes are read from the rank files that hold them, a whole checksum chunk at a time, each
// chunk checked against its chunk_xxh3 (and decoded when zstd) before any of its bytes is
// used. `reshard.load` from another layout (reshard/runtime/source_load.h) and the offline
// `reshard reshard` (reshard/ops/reshard.h) plan over the virtual checkpoint exactly as convert
// plans over a Hugging Face checkpoint, and fill entries through this reader.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/plan/layout_tensors.h"

namespace reshard {

/// The tensors of a layout laid end to end in one virtual file (file index 0): tensor i's
/// bytes are [starts[i], starts[i] + nbytes).
struct LayoutBytes {
  std::vector<RankFileReader> readers;  // readers[r]: the rank file pieces' `rank` r names
  std::vector<TensorLocation> tensors;
  std::vector<uint64_t> starts;

  /// Where virtual byte `offset` lies: the piece holding it, the byte's position in the
  /// piece's entry (decoded bytes), and how many bytes of the piece follow from it.
  struct Spot {
    const TensorPiece* piece = nullptr;
    uint64_t pos = 0;   // in the entry's decoded bytes
    uint64_t left = 0;  // bytes of the piece from `pos` on
  };
  /// False when `offset` is outside every tensor.
  bool Locate(uint64_t offset, Spot& spot) const;

  /// Lays `tensors` end to end (sets `starts`) and returns the virtual checkpoint: one
  /// SourceTensor per tensor (file index 0 at its start), sorted by name, with `source` as
  /// its fingerprint and `dir` as its directory.
  Checkpoint Index(const std::filesystem::path& dir, const SourceFingerprint& source);
};

/// One thread's reader of the virtual file (not thread-safe; one per thread). `verify`: check
/// every chunk read against its chunk_xxh3 (chunks that are only partly needed are always
/// read whole and checked when verify is set); `hash_piece`: hash each piece of a chunk as it
/// is read (0: the chunk whole). `direct`: the rank files opened O_DIRECT (direct[r] is
/// bytes.readers[r]'s file; OpenDirect), read through this reader's DirectReader instead of
/// the page cache (hash_piece unused then), or null.
class LayoutByteReader {
 public:
  LayoutByteReader(const LayoutBytes& bytes, bool verify, uint64_t hash_piece = 0,
                   const std::vector<File>* direct = nullptr)
      : b_(bytes), verify_(verify), hash_piece_(hash_piece), direct_(direct) {}

  /// Reads virtual bytes [offset, offset + size) into `dst`. Throws reshard::Error naming the
  /// rank file on a checksum mismatch, a short read, a bad frame.
  void Read(uint64_t offset, size_t size, void* dst);

  /// Chunks read because only part of them was wanted (each read whole and checked), and how
  /// many of those are kept now: what tests check of the cache.
  uint64_t partial_chunk_reads() const { return partial_reads_; }
  size_t kept_chunks() const { return cache_.size(); }

 private:
  void ReadEntry(uint32_t rank, size_t entry, uint64_t pos, uint64_t n, char* out);
  // Where rank file `rank`'s chunks are read from (its O_DIRECT file, when direct).
  DirectSource Direct(uint32_t rank) {
    return {direct_ ? &(*direct_)[rank] : nullptr, &reader_};
  }

  const LayoutBytes& b_;
  bool verify_;
  uint64_t hash_piece_;
  const std::vector<File>* direct_;
  DirectReader reader_;
  // Chunks read in part, decoded and checked, least recently used out first: one until a
  // chunk has to be read again, then up to kCachedChunks of them, kCachedBytes in all (the
  // one being read always fits). A DTensor
  // layout's Shard(1) tensor interleaves its ranks row by row (each row is one run of every
  // tensor-parallel rank): one cached chunk per rank reads each chunk once instead of once per
  // row (up to 16 tensor-parallel ranks).
  static constexpr size_t kCachedChunks = 16;
  static constexpr uint64_t kCachedBytes = 32ull << 20;
  struct Cached {
    uint32_t rank = 0;
    size_t entry = 0;
    uint64_t chunk = 0;
    uint64_t used = 0;  // clock_ at its last use
    std::vector<char> bytes;
  };
  std::vector<Cached> cache_;
  size_t limit_ = 1;  // chunks kept: kCachedChunks once a chunk had to be read again
  struct ChunkKey {
    uint32_t rank;
    size_t entry;
    uint64_t chunk;
    bool operator==(const ChunkKey&) const = default;
  };
  std::vector<ChunkKey> seen_;  // the last kCachedChunks chunks read in part (a ring)
  size_t seen_next_ = 0;
  uint64_t partial_reads_ = 0;
  uint64_t clock_ = 0;
  std::string frame_;
};

/// Layout `key` of the reshard output `out`, complete, every rank file the one OUT's manifest
/// lists (CheckListed), described (DescribeLayoutTensors) and indexed. `manifest`: OUT's,
/// read by the caller. Throws kNotFound (no such layout, a missing rank file), kMismatch (an
/// incomplete layout, a file that is not the listed one), kDataLoss (a corrupt header).
struct OpenedLayout {
  LayoutBytes bytes;
  Checkpoint view;          // the virtual checkpoint (LayoutBytes::Index)
  std::filesystem::path dir;  // OUT/<the layout's directory>
  std::string description;  // "layout KEY of OUT"
};
/// The rank files are opened (headers parsed and checked) in parallel, one thread per file up to
/// the hardware's concurrency: the time to open a layout of many ranks is that of its largest
/// header, not their sum. `headers`: a cache of parsed headers (a second open of an unchanged
/// file parses nothing), or nullptr.
void OpenLayout(const std::filesystem::path& out, const Manifest& manifest, const std::string& key,
                OpenedLayout& opened, HeaderCache* headers = nullptr);

}  // namespace reshard
