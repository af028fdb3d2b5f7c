#include "reshard/layout.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>

#include "reshard/checksum.h"

#include "reshard/dtype_convert.h"
#include "reshard/error.h"
#include "reshard/fsdp1.h"
#include "reshard/rank_file_format.h"

namespace reshard {

RowRange ChunkRows(uint64_t n, uint64_t world_size, uint64_t rank) {
  const uint64_t c = CeilDiv(n, world_size);
  // r·c can pass 2^64 when n is near 2^64 (e.g. n = 2^64 − 1, W = 2, r + 1 = 2); the result
  // is clamped to n anyway, so saturate instead of wrapping.
  auto boundary = [&](uint64_t r) {
    uint64_t v;
    return __builtin_mul_overflow(r, c, &v) ? n : std::min(v, n);
  };
  return {boundary(rank), boundary(rank + 1)};
}

std::string LayoutSpec::KindName() const {
  switch (kind) {
    case LayoutKind::kFsdp2: return "fsdp2";
    case LayoutKind::kFsdp1: return "fsdp1";
  }
  return "unknown";
}

std::string LayoutSpec::Key() const {
  std::string key = KindName() + "-ws" + std::to_string(world_size);
  if (kind == LayoutKind::kFsdp1) {
    std::string classes;
    for (const auto& w : wrap) classes += (classes.empty() ? "" : ".") + w;
    if (classes.empty()) {
      classes = "nowrap";
    } else if (classes.size() > 64) {
      char buf[17];
      std::snprintf(buf, sizeof buf, "%08llx",
                    static_cast<unsigned long long>(Xxh3(classes) & 0xffffffffu));
      classes = std::string("w") + buf;
    }
    key += "-" + classes;
    if (use_orig_params) key += "-orig";
    if (use_orig_params && !param_dtype.empty()) key += "-p" + param_dtype;
  }
  if (dtype != "keep") key += "-" + dtype;
  return key;
}

void LayoutSpec::Normalize() {
  if (kind != LayoutKind::kFsdp1) {
    if (!wrap.empty() || use_orig_params || !param_dtype.empty()) {
      Fail(ErrorCode::kInvalidArgument,
           "--wrap, --use-orig-params and --param-dtype apply to --layout fsdp1 only");
    }
    return;
  }
  std::set<std::string> unique(wrap.begin(), wrap.end());
  wrap.assign(unique.begin(), unique.end());
  for (const auto& w : wrap) {
    if (w.empty()) Fail(ErrorCode::kInvalidArgument, "--wrap: an empty class name");
    for (char c : w) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) {
        Fail(ErrorCode::kInvalidArgument, "--wrap " + w + ": not a Python class name");
      }
    }
  }
  if (!use_orig_params) param_dtype.clear();  // alignment padding exists only with it
  if (!param_dtype.empty() && param_dtype != "bf16" && param_dtype != "fp16" &&
      param_dtype != "fp32") {
    Fail(ErrorCode::kInvalidArgument,
         "--param-dtype " + param_dtype + " is not one of bf16, fp16, fp32");
  }
}

std::optional<LayoutKind> ParseLayoutKind(std::string_view name) {
  if (name == "fsdp2") return LayoutKind::kFsdp2;
  if (name == "fsdp1") return LayoutKind::kFsdp1;
  return std::nullopt;
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
    const SourceTensor& first = *ckpt.Find(flat->params.front().key);
    PlannedTensor t;
    t.source_index = &first - ckpt.tensors.data();
    t.name = FlatEntryName(flat->unit);
    t.dtype = StoredDType(first.dtype, policy);
    t.source_dtype = t.dtype;  // per parameter inside FillFlatShard
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

RankPlan PlanRank(const Checkpoint& ckpt, const LayoutSpec& layout, uint32_t rank) {
  if (layout.kind != LayoutKind::kFsdp2) {
    Fail(ErrorCode::kInvalidArgument, "layout " + layout.Key() + " needs the model's units");
  }
  const DTypePolicy policy = CheckRankAndPolicy(layout, rank);
  RankPlan plan;
  plan.rank = rank;
  // File order is source order (file, offset): the converter then reads every source file
  // front to back and writes every rank file front to back.
  std::vector<size_t> order(ckpt.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto& x = ckpt.tensors[a];
    const auto& y = ckpt.tensors[b];
    if (x.file_index != y.file_index) return x.file_index < y.file_index;
    if (x.offset != y.offset) return x.offset < y.offset;
    return a < b;  // tensors sharing bytes (torch archives): name order
  });
  uint64_t offset = 0;
  for (size_t i : order) {
    const SourceTensor& src = ckpt.tensors[i];
    PlannedTensor t;
    t.source_index = i;
    t.name = src.name;
    t.source_dtype = src.dtype;
    t.dtype = StoredDType(src.dtype, policy);
    t.global_shape = src.shape;
    t.local_shape = src.shape;
    if (src.shape.empty()) {
      t.sharded = false;
      t.source_nbytes = src.nbytes;
      t.nbytes = t.converted() ? Info(t.dtype).bits / 8 : src.nbytes;  // one element
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
