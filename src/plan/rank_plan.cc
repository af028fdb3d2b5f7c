#include "reshard/plan/rank_plan.h"

#include <algorithm>
#include <string>

#include "reshard/base/dtype_convert.h"
#include "reshard/base/error.h"
#include "reshard/format/parallel_plan.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/plan/fsdp1.h"

namespace reshard {

TensorEntry PlannedEntry(const PlannedTensor& p) {
  TensorEntry e;
  e.name = p.name;
  e.dtype = p.dtype;
  e.global_shape = p.global_shape;
  e.sharded = p.sharded;
  e.rows = p.rows;
  e.local_shape = p.local_shape;
  e.flat = p.flat;
  e.dtensor = p.dtensor;
  return e;
}

namespace {

// The checks both PlanRank overloads start with; returns the layout's dtype policy.
DTypePolicy CheckRankAndPolicy(const LayoutSpec& layout, uint32_t rank) {
  if (layout.world_size == 0 || rank >= layout.world_size) {
    Fail(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) +
                                          " is outside world size " +
                                          std::to_string(layout.world_size));
  }
  const auto policy = ParseDTypePolicy(layout.dtype);
  if (!policy) {
    Fail(ErrorCode::kInvalidArgument,
         "dtype policy \"" + layout.dtype + "\" is not one of keep, bf16, fp16, fp32");
  }
  return *policy;
}

}  // namespace

RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, const Fsdp1Plan& units,
                  uint32_t rank) {
  const DTypePolicy policy = CheckRankAndPolicy(layout, rank);
  RankPlan plan;
  plan.rank = rank;
  uint64_t offset = 0;
  for (const auto& flat : units.units) {
    // The first parameter from the checkpoint (one the model computes at load has no source;
    // fsdp1.cc refuses a unit of only such parameters).
    const FlatParamInfo* sourced = nullptr;
    for (const FlatParamInfo& p : flat->params) {
      if (!p.key.empty()) {
        sourced = &p;
        break;
      }
    }
    if (!sourced) {
      Fail(ErrorCode::kUnsupported, "unit \"" + flat->unit + "\" holds no parameter of the checkpoint");
    }
    const SourceTensor& first = *ckpt.Find(sourced->key);
    PlannedTensor t;
    t.source_index = &first - ckpt.tensors.data();
    t.name = FlatEntryName(flat->unit);
    t.dtype = StoredDType(first.dtype, policy);
    t.source_dtype = t.dtype;  // per parameter: the byte map's (reshard/plan/byte_map.h)
    t.global_shape = {flat->numel};
    t.sharded = true;
    const uint64_t c = CeilDiv(flat->numel, layout.world_size);
    t.rows = ChunkRows(flat->numel, layout.world_size, rank);  // the rest of the c is zeros
    t.local_shape = {c};
    t.nbytes = CheckedMul(c, Info(t.dtype).bits / 8, "unit \"" + flat->unit + "\"");
    t.source_nbytes = t.nbytes;
    t.source_offset = first.offset;
    t.flat = flat;
    t.offset = offset;
    offset = AlignUp(offset + t.nbytes, kDataAlignment);
    plan.tensors.push_back(std::move(t));
  }
  for (size_t i : units.buffers) {
    const SourceTensor& src = ckpt.tensors[i];
    PlannedTensor t;
    t.source_index = i;
    t.name = src.name;
    t.source_dtype = src.dtype;
    t.dtype = StoredDType(src.dtype, policy);
    t.global_shape = t.local_shape = src.shape;
    t.sharded = false;
    t.source_nbytes = src.nbytes;
    t.nbytes = src.nbytes;
    if (t.converted()) {
      uint64_t numel = 1;
      for (uint64_t d : src.shape) numel = CheckedMul(numel, d, "buffer " + src.name);
      t.nbytes = CheckedMul(numel, Info(t.dtype).bits / 8, "buffer " + src.name);
    }
    t.source_offset = src.offset;
    t.offset = offset;
    offset = AlignUp(offset + t.nbytes, kDataAlignment);
    plan.tensors.push_back(std::move(t));
  }
  plan.data_size = offset;
  return plan;
}

namespace {

// File order is source order (file, offset): the converter then reads every source file
// front to back and writes every rank file front to back.
std::vector<size_t> SourceOrder(const Checkpoint& ckpt) {
  std::vector<size_t> order(ckpt.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto& x = ckpt.tensors[a];
    const auto& y = ckpt.tensors[b];
    if (x.file_index != y.file_index) return x.file_index < y.file_index;
    if (x.offset != y.offset) return x.offset < y.offset;
    return a < b;  // tensors sharing bytes (torch archives): name order
  });
  return order;
}

}  // namespace

RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, const ParallelPlan& parallel,
                  uint32_t rank, const std::set<std::string>& whole, const std::string& plan_path) {
  if (layout.kind != LayoutKind::kDTensor || layout.mesh.Size() != layout.world_size) {
    Fail(ErrorCode::kInvalidArgument, "layout " + layout.Key() + " is not a DTensor layout of its mesh");
  }
  const DTypePolicy policy = CheckRankAndPolicy(layout, rank);
  const std::vector<uint32_t> coordinate = layout.mesh.Coordinate(rank);
  RankPlan plan;
  plan.rank = rank;
  uint64_t offset = 0;
  for (size_t i : SourceOrder(ckpt)) {
    const SourceTensor& src = ckpt.tensors[i];
    const std::string what = "tensor \"" + src.name + "\"";
    PlannedTensor t;
    t.source_index = i;
    t.name = src.name;
    t.source_dtype = src.dtype;
    t.dtype = StoredDType(src.dtype, policy);
    if (Info(src.dtype).bits % 8 != 0 || Info(t.dtype).bits % 8 != 0) {
      Fail(ErrorCode::kUnsupported, what + ": " + std::string(Name(src.dtype)) +
                                        " elements are not whole bytes; DTensor layouts need them");
    }
    t.global_shape = src.shape;
    t.dtensor = PlanSharding(parallel, layout.mesh, src.name, src.shape.size(), whole.count(src.name) > 0,
                             plan_path);
    t.local_shape = DTensorLocalShape(src.shape, *t.dtensor, layout.mesh.shape, coordinate, plan_path + ": " + what);
    uint64_t numel = 1;
    for (uint64_t d : t.local_shape) numel = CheckedMul(numel, d, what);
    t.sharded = false;  // `dtensor` says what the rank holds
    t.nbytes = CheckedMul(numel, Info(t.dtype).bits / 8, what);
    t.source_nbytes = CheckedMul(numel, Info(src.dtype).bits / 8, what);
    t.source_offset = src.offset;  // the tensor's first byte: the map gives the rank's parts
    t.offset = offset;
    offset = AlignUp(offset + t.nbytes, kDataAlignment);
    plan.tensors.push_back(std::move(t));
  }
  plan.data_size = offset;
  return plan;
}

RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, uint32_t rank,
                  const std::set<std::string>& whole) {
  if (layout.kind != LayoutKind::kFsdp2) {
    Fail(ErrorCode::kInvalidArgument, "layout " + layout.Key() + " needs the model's units");
  }
  const DTypePolicy policy = CheckRankAndPolicy(layout, rank);
  RankPlan plan;
  plan.rank = rank;
  uint64_t offset = 0;
  for (size_t i : SourceOrder(ckpt)) {
    const SourceTensor& src = ckpt.tensors[i];
    PlannedTensor t;
    t.source_index = i;
    t.name = src.name;
    t.source_dtype = src.dtype;
    t.dtype = StoredDType(src.dtype, policy);
    t.global_shape = src.shape;
    t.local_shape = src.shape;
    if (src.shape.empty() || whole.count(src.name)) {
      t.sharded = false;
      t.source_nbytes = src.nbytes;
      t.nbytes = src.nbytes;
      if (t.converted()) {
        uint64_t numel = 1;
        for (uint64_t d : src.shape) numel = CheckedMul(numel, d, "tensor \"" + src.name + "\"");
        t.nbytes = CheckedMul(numel, Info(t.dtype).bits / 8, "tensor \"" + src.name + "\"");
      }
      t.source_offset = src.offset;
    } else {
      t.sharded = true;
      t.rows = ChunkRows(src.shape[0], layout.world_size, rank);
      t.local_shape[0] = t.rows.size();
      uint64_t row_numel = 1;
      for (size_t d = 1; d < src.shape.size(); ++d) row_numel *= src.shape[d];
      auto row_bytes = BytesFor(src.dtype, row_numel);
      if (!row_bytes) {
        Fail(ErrorCode::kUnsupported,
             "tensor \"" + src.name + "\": a dim-0 row of " + std::to_string(row_numel) + " " +
                 std::string(Name(src.dtype)) +
                 " elements is not a whole number of bytes, so it cannot be split by rows");
      }
      t.source_nbytes = *row_bytes * t.rows.size();
      t.nbytes = t.source_nbytes;
      if (t.converted()) {
        t.nbytes = CheckedMul(CheckedMul(row_numel, t.rows.size(), "tensor \"" + src.name + "\""),
                              Info(t.dtype).bits / 8, "tensor \"" + src.name + "\"");
      }
      t.source_offset = src.offset + *row_bytes * t.rows.start;
    }
    t.offset = offset;
    offset = AlignUp(offset + t.nbytes, kDataAlignment);
    plan.tensors.push_back(std::move(t));
  }
  plan.data_size = offset;
  return plan;
}

}  // namespace reshard
