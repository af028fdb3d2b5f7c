#include "reshard/plan/optim_state.h"

#include <algorithm>
#include <memory>
#include <set>
#include <unordered_map>

#include "reshard/base/error.h"
#include "reshard/format/shape.h"
#include "reshard/plan/rank_plan.h"

namespace reshard {

namespace {

uint64_t ElementBytes(DType dtype, const std::string& what) {
  const uint32_t bits = Info(dtype).bits;
  if (bits == 0 || bits % 8 != 0) {
    Fail(ErrorCode::kUnsupported, what + ": optimizer state of dtype " + std::string(Name(dtype)) +
                                      " (not whole bytes per element) cannot be resharded");
  }
  return bits / 8;
}

uint64_t NumelOf(const std::vector<uint64_t>& shape, const std::string& what) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = CheckedMul(n, d, what);
  return n;
}

// "<parameter>#<state key>" split at the last '#'; false when there is none.
bool SplitStateName(const std::string& name, std::string& param, std::string& key) {
  const size_t at = name.rfind(kOptimSep);
  if (at == std::string::npos || at == 0 || at + 1 == name.size()) return false;
  param = name.substr(0, at);
  key = name.substr(at + 1);
  return true;
}

std::string OrigName(const FlatInfo& f, const FlatParamInfo& p) {
  return f.unit.empty() ? p.fqn : f.unit + "." + p.fqn;
}

}  // namespace

std::vector<TensorLocation> DescribeOptimizerTensors(const RankFileHeader& model0,
                                                     const std::vector<const RankFileHeader*>& optim,
                                                     const std::vector<std::string>& paths) {
  if (optim.empty() || paths.size() != optim.size()) {
    Fail(ErrorCode::kInvalidArgument, "DescribeOptimizerTensors: no optimizer rank file headers");
  }
  if (model0.kind != LayoutKind::kFsdp1) return DescribeLayoutTensors(optim, paths);
  const uint32_t world = static_cast<uint32_t>(optim.size());
  // The units' flat entries, and each original parameter's unit.
  std::unordered_map<std::string, const FlatInfo*> flats;
  std::unordered_map<std::string, std::pair<const FlatInfo*, const FlatParamInfo*>> orig;
  std::unordered_map<std::string, std::string> key_owner;  // parameter key -> first flat entry
  for (const TensorEntry& e : model0.tensors) {
    if (!e.flat) continue;
    flats.emplace(e.name, e.flat.get());
    for (const FlatParamInfo& p : e.flat->params) {
      orig.emplace(OrigName(*e.flat, p), std::make_pair(e.flat.get(), &p));
      key_owner.emplace(p.key, e.name);
    }
  }
  std::vector<TensorLocation> out;
  std::unordered_map<std::string, size_t> where;
  auto loc = [&](const std::string& name, DType dtype, const std::vector<uint64_t>& shape,
                 const std::string& path) -> TensorLocation& {
    auto [it, fresh] = where.emplace(name, out.size());
    if (fresh) {
      const std::string what = path + ": tensor \"" + name + "\"";
      out.push_back({name, dtype, shape, CheckedMul(NumelOf(shape, what), ElementBytes(dtype, what), what), {}});
    } else if (out[it->second].dtype != dtype || out[it->second].shape != shape) {
      Fail(ErrorCode::kMismatch, path + ": optimizer state \"" + name + "\" is " + std::string(Name(dtype)) +
                                     " here, " + std::string(Name(out[it->second].dtype)) +
                                     " (or of another shape) on another rank");
    }
    return out[it->second];
  };
  for (uint32_t r = 0; r < world; ++r) {
    const RankFileHeader& h = *optim[r];
    const std::string& path = paths[r];
    if (h.rank != r || h.world_size != world || h.kind != LayoutKind::kFsdp1) {
      Fail(ErrorCode::kMismatch, path + ": holds rank " + std::to_string(h.rank) + " of layout " + h.layout_key +
                                     " (world size " + std::to_string(h.world_size) + "), expected rank " +
                                     std::to_string(r) + " of an FSDP1 layout of world size " +
                                     std::to_string(world));
    }
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const TensorEntry& e = h.tensors[i];
      const std::string what = path + ": tensor \"" + e.name + "\"";
      std::string param, key;
      if (!SplitStateName(e.name, param, key)) {
        Fail(ErrorCode::kDataLoss, what + ": not named <parameter>#<state key>");
      }
      if (e.sharded || e.flat) {
        Fail(ErrorCode::kDataLoss, what + ": FSDP1 optimizer state is stored whole (kind local or whole), "
                                          "found a sharded entry");
      }
      if (e.global_shape.empty()) {  // 0-dim (step): the same on every rank holding it
        TensorLocation& l = loc(e.name, e.dtype, {}, path);
        if (l.pieces.empty()) l.pieces.push_back({r, i, 0, 0, e.nbytes});
        continue;
      }
      const uint64_t isz = ElementBytes(e.dtype, what);
      if (const auto f = flats.find(param); f != flats.end()) {
        // The rank's shard of a flat parameter laid out as the unit's, in the state's dtype.
        const FlatInfo& flat = *f->second;
        const uint64_t c = CeilDiv(flat.numel, world);
        const uint64_t lo = CheckedMul(uint64_t{r}, c, what), hi = lo + c;
        if (e.global_shape.size() != 1 || e.nbytes != CheckedMul(c, isz, what)) {
          Fail(ErrorCode::kMismatch, what + ": local state of shape [" +
                                         (e.global_shape.empty() ? "" : std::to_string(e.global_shape[0])) +
                                         (e.global_shape.size() > 1 ? ", ..." : "") + "], expected [" +
                                         std::to_string(c) + "] (rank " + std::to_string(r) +
                                         "'s shard of " + param + ", " + std::to_string(flat.numel) +
                                         " elements over " + std::to_string(world) + " ranks)");
        }
        for (const FlatParamInfo& p : flat.params) {
          if (key_owner[p.key] != param) continue;  // a tied copy in a second unit: described once
          const uint64_t a = std::max(lo, p.offset);
          const uint64_t b = std::min(hi, p.offset + p.numel);
          if (a >= b) continue;
          loc(p.key + kOptimSep + key, e.dtype, p.shape, path)
              .pieces.push_back({r, i, (a - lo) * isz, (a - p.offset) * isz, (b - a) * isz});
        }
      } else if (const auto o = orig.find(param); o != orig.end()) {
        // use_orig_params: the parameter's elements inside the rank's shard.
        const FlatInfo& flat = *o->second.first;
        const FlatParamInfo& p = *o->second.second;
        const uint64_t c = CeilDiv(flat.numel, world);
        const uint64_t lo = CheckedMul(uint64_t{r}, c, what), hi = lo + c;
        const uint64_t a = std::max(lo, p.offset);
        const uint64_t b = std::min(hi, p.offset + p.numel);
        const uint64_t want = a < b ? b - a : 0;
        if (e.nbytes != CheckedMul(want, isz, what)) {
          Fail(ErrorCode::kMismatch, what + ": local state of " + std::to_string(e.nbytes / isz) +
                                         " elements, expected " + std::to_string(want) + " (the elements of " +
                                         param + " inside rank " + std::to_string(r) + "'s shard of unit \"" +
                                         flat.unit + "\")");
        }
        if (want) loc(e.name, e.dtype, p.shape, path).pieces.push_back({r, i, 0, (a - p.offset) * isz, want * isz});
      } else {
        Fail(ErrorCode::kMismatch, what + ": state of \"" + param + "\", which is neither a unit's flat "
                                          "parameter nor an original parameter of the model layout " +
                                          model0.layout_key);
      }
    }
  }
  for (TensorLocation& l : out) CheckTensorPieces(l, optim, paths);
  return out;
}

std::vector<PlannedState> PlanOptimizerRank(const Checkpoint& view, const LayoutSpec& layout,
                                            uint32_t rank, const RankFileHeader& model_rank,
                                            const std::string& path) {
  // The view's state by parameter, then key.
  std::map<std::string, std::map<std::string, const SourceTensor*>> by_param;
  for (const SourceTensor& t : view.tensors) {
    std::string param, key;
    if (!SplitStateName(t.name, param, key)) {
      Fail(ErrorCode::kDataLoss, path + ": optimizer state \"" + t.name + "\" is not named <parameter>#<state key>");
    }
    by_param[param][key] = &t;
  }
  std::vector<PlannedState> out;
  auto whole = [&](const SourceTensor& t, const std::string& param, const std::string& key) {
    PlannedState s;
    s.entry.name = t.name;
    s.entry.dtype = t.dtype;
    s.entry.global_shape = s.entry.local_shape = t.shape;
    s.entry.nbytes = t.nbytes;
    s.map = MapEntry(s.entry, LayoutKind::kFsdp2, layout.world_size, rank, path);
    s.param = param, s.key = key, s.kind = "whole";
    out.push_back(std::move(s));
  };
  if (layout.kind == LayoutKind::kDTensor) {
    // Each state tensor placed as its parameter is in the model rank file (elementwise state,
    // shaped like the parameter); 0-dim state Replicate everywhere. Source order (file, offset).
    std::unordered_map<std::string_view, const TensorEntry*> model_entry;
    for (const TensorEntry& e : model_rank.tensors) model_entry.emplace(e.name, &e);
    const std::vector<uint32_t> coordinate = layout.mesh.Coordinate(rank);
    std::vector<const SourceTensor*> order;
    for (const SourceTensor& t : view.tensors) order.push_back(&t);
    std::stable_sort(order.begin(), order.end(), [](const SourceTensor* a, const SourceTensor* b) {
      return a->file_index != b->file_index ? a->file_index < b->file_index : a->offset < b->offset;
    });
    for (const SourceTensor* t : order) {
      PlannedState s;
      SplitStateName(t->name, s.param, s.key);
      const std::string what = path + ": optimizer state \"" + t->name + "\"";
      ElementBytes(t->dtype, what);
      s.entry.name = t->name;
      s.entry.dtype = t->dtype;
      s.entry.global_shape = t->shape;
      DTensorSharding sharding;
      if (t->shape.empty()) {
        sharding.placements.assign(layout.mesh.ndim(), Placement::Replicate());
        sharding.mesh_shape = layout.mesh.shape;
        s.kind = "whole";
      } else {
        const auto it = model_entry.find(s.param);
        if (it == model_entry.end() || !it->second->dtensor) {
          Fail(ErrorCode::kMismatch, what + ": its parameter \"" + s.param + "\" is no tensor of the model " +
                                         "rank file of layout " + layout.Key() + "; expected state of its parameters");
        }
        if (it->second->global_shape != t->shape) {
          Fail(ErrorCode::kMismatch, what + ": shape " + ShapeText(t->shape) + ", its parameter's " +
                                         ShapeText(it->second->global_shape) +
                                         "; a DTensor layout places state shaped like its parameter, or 0-dim");
        }
        sharding = *it->second->dtensor;
        s.kind = "sharded";
      }
      s.entry.local_shape = DTensorLocalShape(t->shape, sharding, layout.mesh.shape, coordinate, what);
      s.entry.dtensor = std::move(sharding);
      s.entry.nbytes = CheckedMul(NumelOf(s.entry.local_shape, what), ElementBytes(t->dtype, what), what);
      s.map = MapEntry(s.entry, layout.kind, layout.world_size, rank, path);
      out.push_back(std::move(s));
    }
    return out;
  }
  if (layout.kind != LayoutKind::kFsdp1) {
    LayoutSpec keep = layout;
    keep.dtype = "keep";  // state is stored in its own dtype
    const RankPlan plan = PlanRank(view, keep, rank);
    for (const PlannedTensor& p : plan.tensors) {
      PlannedState s;
      s.entry = PlannedEntry(p);
      s.entry.nbytes = p.nbytes;
      s.map = MapEntry(s.entry, layout.kind, layout.world_size, rank, path);
      SplitStateName(p.name, s.param, s.key);
      s.kind = p.global_shape.empty() ? "whole" : "sharded";
      out.push_back(std::move(s));
    }
    return out;
  }
  const uint32_t world = layout.world_size;
  for (const TensorEntry& u : model_rank.tensors) {
    if (!u.flat) continue;
    const FlatInfo& flat = *u.flat;
    const uint64_t c = CeilDiv(flat.numel, world);
    const uint64_t lo = uint64_t{rank} * c, hi = lo + c;
    const std::string uwhat = path + ": unit \"" + flat.unit + "\"";
    if (!layout.use_orig_params) {
      // One flat-shard state per key of the unit's parameters' state; 0-dim state by the
      // flat parameter's name.
      std::map<std::string, DType> keys;
      for (const FlatParamInfo& p : flat.params) {
        const auto it = by_param.find(p.key);
        if (it == by_param.end()) continue;
        for (const auto& [k, t] : it->second) {
          if (!t->shape.empty()) keys.emplace(k, t->dtype);
        }
      }
      std::map<std::string, const SourceTensor*> zero_dim;
      if (const auto it = by_param.find(u.name); it != by_param.end()) {
        for (const auto& [k, t] : it->second) {
          if (t->shape.empty()) zero_dim.emplace(k, t);
        }
      }
      if (keys.empty() && zero_dim.empty()) continue;  // no state for this unit
      for (const auto& [k, dtype] : keys) {
        auto syn_flat = std::make_shared<FlatInfo>(flat);
        for (FlatParamInfo& p : syn_flat->params) {
          const SourceTensor* t = view.Find(p.key + kOptimSep + k);
          if (!t) {
            Fail(ErrorCode::kMismatch, uwhat + ": parameter " + p.key + " has no optimizer state \"" + k +
                                           "\", which other parameters of its flat parameter " + u.name +
                                           " have (the state of a flat parameter covers all of them)");
          }
          if (t->dtype != dtype || t->shape != p.shape) {
            Fail(ErrorCode::kMismatch, uwhat + ": optimizer state " + t->name + " is " +
                                           std::string(Name(t->dtype)) + " of another dtype or shape than " +
                                           "the rest of " + u.name + "'s state \"" + k + "\" (" +
                                           std::string(Name(dtype)) + ")");
          }
          p.key += kOptimSep + k;
        }
        const std::string name = u.name + kOptimSep + k;
        const uint64_t nbytes = CheckedMul(c, ElementBytes(dtype, uwhat), uwhat);
        TensorEntry syn = u;  // the unit's flat shard, in the state's dtype, over the state
        syn.name = name;
        syn.dtype = dtype;
        syn.flat = syn_flat;
        syn.nbytes = nbytes;
        PlannedState s;
        s.map = MapEntry(syn, LayoutKind::kFsdp1, world, rank, path);
        for (EntrySegment& seg : s.map.segments) {
          if (seg.kind == EntrySegment::Kind::kPadding) seg.kind = EntrySegment::Kind::kZero;  // no 42s in state
        }
        s.entry.name = name;
        s.entry.dtype = dtype;
        s.entry.global_shape = s.entry.local_shape = {c};
        s.entry.nbytes = nbytes;
        s.param = u.name, s.key = k, s.kind = "local";
        out.push_back(std::move(s));
      }
      for (const auto& [k, t] : zero_dim) whole(*t, u.name, k);
      continue;
    }
    for (const FlatParamInfo& p : flat.params) {
      const uint64_t a = std::max(lo, p.offset);
      const uint64_t b = std::min(hi, p.offset + p.numel);
      if (a >= b) continue;  // no elements here: no state on this rank
      const std::string param = OrigName(flat, p);
      const auto it = by_param.find(param);
      if (it == by_param.end()) continue;
      for (const auto& [k, t] : it->second) {
        if (t->shape.empty()) {
          whole(*t, param, k);
          continue;
        }
        const std::string what = path + ": optimizer state \"" + t->name + "\"";
        if (t->shape != p.shape) {
          Fail(ErrorCode::kMismatch, what + ": shaped unlike its parameter in unit \"" + flat.unit + "\"");
        }
        PlannedState s;
        s.entry.name = t->name;
        s.entry.dtype = t->dtype;
        s.entry.global_shape = s.entry.local_shape =
            world == 1 ? p.shape : std::vector<uint64_t>{b - a};
        s.entry.nbytes = CheckedMul(b - a, ElementBytes(t->dtype, what), what);
        s.map.name = t->name;
        s.map.dtype = t->dtype;
        s.map.numel = b - a;
        s.map.nbytes = s.entry.nbytes;
        EntrySegment seg;
        seg.kind = EntrySegment::Kind::kSource;
        seg.element = 0;
        seg.count = b - a;
        seg.source = t->name;
        seg.source_shape = p.shape;
        seg.source_element = a - p.offset;
        s.map.segments.push_back(std::move(seg));
        s.param = param, s.key = k, s.kind = "local";
        out.push_back(std::move(s));
      }
    }
  }
  return out;
}

}  // namespace reshard
