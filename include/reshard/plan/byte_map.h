// The one byte map of every layout: which elements of which source tensor each part of a
// rank-file entry holds, computed from the entry's header fields alone (name, dtype, global
// shape, rows, flat object). `reshard convert` fills entries by it, `reshard verify` compares
// entries with it, and DescribeLayoutTensors (reshard/plan/layout_tensors.h, behind `reshard
// export`) inverts it. A new layout kind adds its case to MapEntry and nothing else.
// Pure: source bytes come through the caller's SourceRead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/dtensor.h"
#include "reshard/format/layout.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {

/// A run of consecutive elements of an entry: `count` elements from entry element `element`
/// on, holding source tensor `source`'s elements [source_element, source_element + count)
/// (row-major), or padding: FSDP1's 42 inside a flat parameter, zeros past its end, and zeros
/// where a flat parameter holds a parameter the model computes at load (`source`: its FQN).
/// kStrided (DTensor layouts): the `count` elements are rows of `row` = Σ runs[j].length
/// elements; row k holds source elements [source_element + k·stride + runs[j].start, ... +
/// runs[j].length) for each run j in order (a box of a Shard(1) tensor: one run per row, every
/// `stride` elements). Only for dtypes of whole bytes.
/// kDequantFp8: the same elements of F8_E4M3 `source` ([..., R, C]) dequantized as
/// transformers' Fp8Dequantize: float32(weight) × float32 scale of its block (F32 `scale`,
/// [..., ceil(R/block_rows), ceil(C/block_cols)]), rounded once to the entry's dtype.
struct EntrySegment {
  enum class Kind : uint8_t { kSource, kPadding, kZero, kDequantFp8, kDequantMxfp4, kStrided };
  Kind kind = Kind::kSource;
  uint64_t element = 0;
  uint64_t count = 0;
  std::string source;                 // kSource, kDequant*: the source tensor's name (MXFP4: blocks)
  std::vector<uint64_t> source_shape;  // kSource, kDequant*: the shape that tensor must have
  uint64_t source_element = 0;         // kSource, kDequant* (MXFP4: of the [E, G·32, N] result)
  std::string scale;                   // kDequant*: the scale tensor's name
  std::vector<uint64_t> scale_shape;   // kDequant*: the shape it must have
  uint64_t block_rows = 0, block_cols = 0;  // kDequantFp8
  uint64_t stride = 0;                 // kStrided: source elements from one row to the next
  std::vector<IndexRun> runs;          // kStrided: one row's runs, relative to the row's start

  bool IsSourced() const { return kind == Kind::kSource || kind == Kind::kStrided; }
  /// kStrided: elements of one row.
  uint64_t RowElements() const;
  /// kSource, kStrided: the source element that element `i` (< count) of the segment holds.
  uint64_t SourceElementAt(uint64_t i) const;
};

/// Where the bytes of one entry come from. Element e of the entry is bits [e·b, (e+1)·b) of
/// its decoded bytes (b = bits of `dtype`); every segment starts on a whole byte.
struct EntryMap {
  std::string name;
  DType dtype = DType::kU8;            // the entry's (stored) dtype
  uint64_t numel = 0;                  // elements of the entry's local shape
  uint64_t nbytes = 0;
  std::vector<EntrySegment> segments;  // in entry order, tiling [0, numel) exactly
};

/// The map of entry `e` of rank `rank` of a layout of kind `kind` over `world_size` shards:
/// FSDP2 (and whole entries of any kind): one segment, rows [start, end) of dim 0 being the
/// source's elements [start·R, end·R) (R elements per row), a whole entry all of it; FSDP1
/// flat entries: the rank's part [r·c, (r+1)·c) of the flat parameter, each original
/// parameter's elements where it lies, padding between and after. DTensor entries (`dtensor`
/// set): the elements of DTensorLocalIndices (reshard/format/dtensor.h) for the rank's mesh
/// coordinate, as few segments as the boxes allow (DTensorSegments). Throws kDataLoss naming
/// `path` when the entry's fields do not fit (rows outside the global shape, sizes that
/// disagree, segment starts inside a byte).
EntryMap MapEntry(const TensorEntry& e, LayoutKind kind, uint32_t world_size, uint32_t rank,
                  const std::string& path);

/// The segments of a local tensor holding `dims` (DTensorLocalIndices) of source tensor
/// `source` of shape `shape`, appended to `out` from entry element `element` on: trailing
/// whole dims are folded into the last cut one, a tensor cut only on its leading (folded) dim
/// is kSource segments (one per run: FSDP2's Shard(0) is one), anything else kStrided
/// segments, one per run of the next-to-last folded dim and index of the dims before it (a
/// [R, C] Shard(1) box is one segment). Returns the elements appended.
uint64_t DTensorSegments(const std::string& source, const std::vector<uint64_t>& shape,
                         const std::vector<IndexRuns>& dims, uint64_t element,
                         std::vector<EntrySegment>& out);

/// Reads exactly `size` bytes at absolute offset `offset` of source file `file_index`
/// (Checkpoint::files order) into `dst`; a short read throws kDataLoss.
using SourceRead = std::function<void(size_t file_index, uint64_t offset, size_t size, void* dst)>;
/// The source tensor called `name`; nullptr when absent.
using SourceLookup = std::function<const SourceTensor*(std::string_view name)>;

/// Checks every source of `map` against `find`: present, of the segment's shape, and of the
/// entry's dtype or one the entry converts from exactly (F16, BF16, F32, F64). Returns why
/// not (the first problem), or an empty string.
std::string CheckSources(const EntryMap& map, const SourceLookup& find);

/// Fills decoded bytes [begin, begin + length) of the entry: each source's elements (copied,
/// or converted exactly as Tensor.to() when the source dtype differs: then `begin` and
/// `length` hold whole elements), 42 for padding, 0 past a flat parameter. Call CheckSources
/// first. Returns the source bytes read.
uint64_t FillEntry(const EntryMap& map, const SourceLookup& find, const SourceRead& read,
                   uint64_t begin, uint64_t length, char* out, std::vector<char>& scratch);

/// (file index, absolute offset) of the first source byte that bytes [begin, ...) read, for
/// ordering reads; (0, 0) when they hold only padding.
std::pair<size_t, uint64_t> FirstSourceByte(const EntryMap& map, const SourceLookup& find,
                                            uint64_t begin);

/// What byte `at` of the entry holds, for messages: "element 7 of source tensor X" or
/// "padding (42)" or "zero padding past the flat parameter".
std::string DescribeEntryByte(const EntryMap& map, uint64_t at);

}  // namespace reshard
