// Constants and structures of the rank file, mirroring formats/rank-file.md one to one.
#pragma once

#include <array>
#include <memory>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/error.h"
#include "reshard/format/dtensor.h"
#include "reshard/format/layout.h"
#include "reshard/format/source.h"

namespace reshard {

inline constexpr std::array<uint8_t, 8> kRankFileMagic = {0x89, 'R', 'S', 'H', 'D', '\r', '\n', 0x1A};
inline constexpr uint32_t kRankFileVersion = 1;
inline constexpr uint64_t kPreambleSize = 64;
inline constexpr uint64_t kPreambleHashedBytes = 56;
inline constexpr uint64_t kDataAlignment = 4096;
inline constexpr uint64_t kDataOffset = 4096;
inline constexpr uint64_t kMaxHeaderSize = 256ull << 20;
// 256 KiB: a reader of part of a file (another world size's load, relayout by parts) reads
// whole chunks, so smaller chunks read fewer bytes it does not need; a rank's own load reads
// spans of many chunks (host loads no slower, the GPU load still to measure: bench/HISTORY.md
// §15; formats/rank-file.md, *Reading part of a file*).
inline constexpr uint64_t kDefaultChunkSize = 256ull << 10;
// The largest chunk_size a reader accepts (formats/rank-file.md), and the largest that
// `reshard convert --chunk-size` writes (each worker thread holds up to three chunk buffers;
// a loader stages whole zstd chunks in pinned memory).
inline constexpr uint64_t kMaxChunkSize = 1ull << 34;
inline constexpr uint64_t kMaxConvertChunkSize = 1ull << 30;
inline constexpr std::string_view kRankFileFormatName = "reshard.rank";
inline constexpr std::string_view kRankFileExtension = ".reshard";

enum class Codec { kRaw, kZstd };
std::string_view CodecName(Codec codec);

struct Preamble {
  uint32_t format_version = kRankFileVersion;
  uint32_t flags = 0;
  uint64_t data_offset = kDataOffset;
  uint64_t data_size = 0;
  uint64_t header_offset = 0;
  uint64_t header_size = 0;
  uint64_t header_xxh3 = 0;
};

std::array<uint8_t, kPreambleSize> EncodePreamble(const Preamble& p);
/// Checks invariants 1–2 of the spec against `file_size`. Throws kDataLoss naming `path`.
Preamble DecodePreamble(const uint8_t* bytes, uint64_t file_size, const std::string& path);

struct Frame {
  uint64_t offset = 0;  // relative to the tensor's offset
  uint64_t size = 0;
};

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<uint64_t> global_shape;
  bool sharded = false;
  RowRange rows;
  std::vector<uint64_t> local_shape;
  uint64_t nbytes = 0;
  uint64_t offset = 0;  // relative to data_offset
  uint64_t stored_size = 0;
  Codec codec = Codec::kRaw;
  std::vector<uint64_t> chunk_xxh3;
  std::vector<Frame> frames;  // zstd only
  uint64_t xxh3 = 0;
  // FSDP1 flat shard: the unit's unsharded layout (global_shape = {flat->numel}, rows the
  // part of [0, numel) in this rank, local_shape = {ceil(numel / W)}). Null otherwise.
  std::shared_ptr<const FlatInfo> flat;
  // DTensor layouts: the entry's placements (mesh_shape: the header's mesh); nullopt
  // otherwise. `sharded` and `rows` are unused then (`shard` is written as null).
  std::optional<DTensorSharding> dtensor;

  uint64_t ChunkCount(uint64_t chunk_size) const { return CeilDiv(nbytes, chunk_size); }
};

/// Chunk `chunk`'s byte range [begin, end) in the decoded tensor.
inline uint64_t ChunkBegin(uint64_t chunk_size, uint64_t chunk) {
  return chunk * chunk_size;
}
inline uint64_t ChunkLength(const TensorEntry& t, uint64_t chunk_size, uint64_t chunk) {
  uint64_t begin = chunk * chunk_size;
  return t.nbytes - begin < chunk_size ? t.nbytes - begin : chunk_size;
}

struct RankFileHeader {
  std::string writer;
  std::string layout_key;
  LayoutKind kind = LayoutKind::kFsdp2;
  uint32_t world_size = 1;
  std::string dtype_policy = "keep";
  std::vector<std::string> wrap;  // FSDP1: LayoutSpec::wrap, use_orig_params, param_dtype
  bool use_orig_params = false;
  std::string param_dtype;
  MeshSpec mesh;  // DTensor: LayoutSpec::mesh, plan_name, plan_xxh3
  std::string plan_name;
  uint64_t plan_xxh3 = 0;
  uint32_t rank = 0;  // DTensor: its mesh coordinate is mesh.Coordinate(rank) (`coordinate`)
  SourceFingerprint source;
  uint64_t chunk_size = kDefaultChunkSize;
  std::vector<TensorEntry> tensors;

  const TensorEntry* Find(std::string_view name) const;
  LayoutSpec Layout() const;
  /// Sets the layout fields from `layout`: its key, kind, world size, dtype policy and FSDP1
  /// fields (the inverse of Layout()).
  void SetLayout(const LayoutSpec& layout);
};

std::string SerializeHeader(const RankFileHeader& header);
/// Parses and checks invariants 3–7 (data_size bounds the tensors). Throws kDataLoss
/// naming `path` and the field.
RankFileHeader ParseHeader(std::string_view json, uint64_t data_size, const std::string& path);

/// "rank-00003-of-00008.reshard"
std::string RankFileName(uint32_t rank, uint32_t world_size);

}  // namespace reshard
