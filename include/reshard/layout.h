// Layout planning: which bytes of which source tensor each rank owns, and where they go in
// the rank file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"

namespace reshard {

enum class LayoutKind { kFsdp2 };

struct RowRange {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - start; }
  bool operator==(const RowRange&) const = default;
};

/// The chunk rule (torch.chunk / FSDP2 _chunk_with_empty): c = ceil(n / W), rank r owns
/// [min(r·c, n), min((r+1)·c, n)). Requires world_size ≥ 1 and rank < world_size.
RowRange ChunkRows(uint64_t n, uint64_t world_size, uint64_t rank);

struct LayoutSpec {
  LayoutKind kind = LayoutKind::kFsdp2;
  uint32_t world_size = 1;
  std::string dtype = "keep";  // the dtype policy: keep, bf16, fp16, fp32 (dtype_convert.h)

  /// Directory name and manifest key, e.g. "fsdp2-ws8", "fsdp2-ws8-bf16".
  std::string Key() const;
  std::string KindName() const;
};

std::optional<LayoutKind> ParseLayoutKind(std::string_view name);

/// One tensor's part in one rank file.
struct PlannedTensor {
  size_t source_index = 0;  // into Checkpoint::tensors
  std::string name;
  DType dtype;              // as stored in the rank file (after the dtype policy)
  DType source_dtype;       // as in the source; differs from dtype when converted
  std::vector<uint64_t> global_shape;
  bool sharded = false;     // false: stored whole (0-dim)
  RowRange rows;            // valid when sharded
  std::vector<uint64_t> local_shape;
  uint64_t nbytes = 0;         // bytes in the rank file
  uint64_t source_nbytes = 0;  // bytes of this rank's part in the source (= nbytes unless converted)
  uint64_t source_offset = 0;  // absolute offset of this rank's bytes in the source file
  uint64_t offset = 0;         // in the data region (raw codec; 4096-aligned)

  bool converted() const { return dtype != source_dtype; }
};

struct RankPlan {
  uint32_t rank = 0;
  std::vector<PlannedTensor> tensors;  // file order = source order (file, offset)
  uint64_t data_size = 0;              // data region size for the raw codec
};

/// Plans rank `rank` of `layout` for `ckpt`, applying the layout's dtype policy (stored dtype
/// and sizes). Throws kInvalidArgument for an unknown dtype policy, kUnsupported when a tensor
/// cannot be split into whole bytes per row (sub-byte dtypes with odd rows).
RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, uint32_t rank);

}  // namespace reshard
