// Layout planning: which bytes of which source tensor each rank owns, and where they go in
// the rank file. Pure: plans from the checkpoint's description (reshard/format/checkpoint.h)
// and the layout's identity (reshard/format/layout.h); reads no file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/layout.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {

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
  // FSDP1 flat shards: the unit (shared by the plans of every rank); source_* then describe
  // the first source bytes and the bytes come from the entry's byte map.
  std::shared_ptr<const FlatInfo> flat;
  // DTensor layouts: the tensor's placements on the mesh (every tensor has them; a whole one
  // is Replicate everywhere); local_shape and nbytes are its local tensor's.
  std::optional<DTensorSharding> dtensor;

  bool converted() const { return dtype != source_dtype; }
};

/// The rank-file entry of a planned tensor: name, dtype, shapes, rows, flat object (a writer
/// lays out its size, offset and checksums).
TensorEntry PlannedEntry(const PlannedTensor& p);

struct RankPlan {
  uint32_t rank = 0;
  std::vector<PlannedTensor> tensors;  // file order = source order (file, offset)
  uint64_t data_size = 0;              // data region size for the raw codec
};

/// Plans rank `rank` of `layout` for `ckpt`, applying the layout's dtype policy (stored dtype
/// and sizes). Throws kInvalidArgument for an unknown dtype policy, kUnsupported when a tensor
/// cannot be split into whole bytes per row (sub-byte dtypes with odd rows).
/// `whole`: tensors stored whole on every rank (FSDP2 does not shard buffers: the model's
/// persistent buffers), besides 0-dim ones.
RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, uint32_t rank,
                  const std::set<std::string>& whole = {});

struct ParallelPlan;  // reshard/format/parallel_plan.h
/// DTensor layouts: every tensor in source order, holding the local tensor of rank `rank`'s
/// mesh coordinate under the placements `plan` gives it on layout.mesh (PlanSharding; `whole`:
/// the model's persistent buffers, Replicate everywhere). Throws kInvalidArgument (naming
/// `plan_path`) for a plan that does not fit a tensor, kUnsupported for dtypes of less than
/// a byte.
RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, const ParallelPlan& plan,
                  uint32_t rank, const std::set<std::string>& whole, const std::string& plan_path);

struct Fsdp1Plan;  // fsdp1.h
/// FSDP1: the rank's flat shards (one per unit, in unit construction order) followed by the
/// model's persistent buffers, stored whole.
RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, const Fsdp1Plan& units,
                  uint32_t rank);

}  // namespace reshard
