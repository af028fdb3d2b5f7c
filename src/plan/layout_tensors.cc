#include "reshard/plan/layout_tensors.h"

#include <algorithm>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

#include "reshard/base/error.h"
#include "reshard/plan/byte_map.h"

namespace reshard {

namespace {

uint64_t WholeBytes(const std::string& path, const std::string& name, DType dtype,
                    const std::vector<uint64_t>& shape) {
  uint64_t numel = 1;
  for (uint64_t d : shape) numel = CheckedMul(numel, d, path + ": tensor \"" + name + "\" shape");
  auto n = BytesFor(dtype, numel);
  if (!n) {
    Fail(ErrorCode::kDataLoss, path + ": tensor \"" + name + "\": " + std::to_string(numel) +
                                   " elements of " + std::string(Name(dtype)) +
                                   " are not a whole number of bytes");
  }
  return *n;
}

// Every entry's byte map (reshard/plan/byte_map.h), inverted: each source segment of an entry
// is a piece of its source tensor. The tensors come in the order rank 0's header names them
// (an FSDP1 flat entry: its parameters in flat order). A whole entry is on every rank; rank
// 0's copy is used.
void DescribeByMaps(const std::vector<const RankFileHeader*>& headers,
                    const std::vector<std::string>& paths, std::vector<TensorLocation>& out) {
  std::unordered_map<std::string, size_t> where;  // source tensor -> index into out
  // (entry, source tensor) of a tied parameter's copy in a second FSDP1 unit (formats/
  // model-manifest.md): the same bytes again, described once, by the first unit.
  std::set<std::pair<std::string, std::string>> copies;
  auto add = [&](const std::string& name, DType dtype, const std::vector<uint64_t>& shape) {
    if (!where.emplace(name, out.size()).second) {
      Fail(ErrorCode::kDataLoss, paths[0] + ": tensor \"" + name + "\" is held by two entries");
    }
    out.push_back({name, dtype, shape, WholeBytes(paths[0], name, dtype, shape), {}});
  };
  std::unordered_map<std::string, std::string> flat_owner;  // source tensor -> first flat entry
  for (const TensorEntry& e : headers[0]->tensors) {
    if (e.flat && headers[0]->kind == LayoutKind::kFsdp1) {
      for (const FlatParamInfo& p : e.flat->params) {
        if (p.key.empty()) continue;  // computed by the model at load: not a checkpoint tensor
        auto [it, first] = flat_owner.emplace(p.key, e.name);
        if (!first && it->second != e.name) {
          copies.emplace(e.name, p.key);
          continue;
        }
        add(p.key, e.dtype, p.shape);
      }
    } else {
      add(e.name, e.dtype, e.global_shape);
    }
  }
  for (uint32_t r = 0; r < headers.size(); ++r) {
    const RankFileHeader& h = *headers[r];
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const TensorEntry& e = h.tensors[i];
      if (e.dtensor) {
        // One copy of each element: the ranks at coordinate 0 of every mesh dim the entry is
        // replicated on.
        const std::vector<uint32_t> c = h.mesh.Coordinate(h.rank);
        bool copy = false;
        for (size_t m = 0; m < c.size() && m < e.dtensor->placements.size(); ++m) {
          copy |= !e.dtensor->placements[m].IsShard() && c[m] != 0;
        }
        if (copy) continue;
      } else if (r > 0 && !e.sharded && !e.flat) {
        continue;
      }
      const EntryMap map = MapEntry(e, h.kind, h.world_size, h.rank, paths[r]);
      const uint32_t bits = Info(e.dtype).bits;
      for (const EntrySegment& s : map.segments) {
        if (!s.IsSourced()) continue;
        if (!copies.empty() && copies.count({e.name, s.source})) continue;
        auto it = where.find(s.source);
        if (it == where.end()) {
          Fail(ErrorCode::kMismatch, paths[r] + ": tensor \"" + s.source + "\" is not in " + paths[0]);
        }
        TensorLocation& loc = out[it->second];
        if (loc.dtype != e.dtype || loc.shape != s.source_shape) {
          Fail(ErrorCode::kMismatch, paths[r] + ": tensor \"" + s.source +
                                         "\" is held with another dtype or shape than in " + paths[0]);
        }
        if (s.kind == EntrySegment::Kind::kStrided) {  // one piece per run of each row
          for (uint64_t k = 0, at = s.element; at < s.element + s.count; ++k) {
            for (const IndexRun& run : s.runs) {
              loc.pieces.push_back({r, i, at * bits / 8, (s.source_element + k * s.stride + run.start) * bits / 8,
                                    run.length * bits / 8});
              at += run.length;
            }
          }
          continue;
        }
        loc.pieces.push_back({r, i, s.element * bits / 8, s.source_element * bits / 8,
                              s.count * bits / 8});
      }
    }
  }
}

}  // namespace

// Whatever the layout kind: the pieces tile [0, nbytes) and stay inside their entries.
void CheckTensorPieces(TensorLocation& loc, const std::vector<const RankFileHeader*>& headers,
                 const std::vector<std::string>& paths) {
  std::sort(loc.pieces.begin(), loc.pieces.end(),
            [](const TensorPiece& a, const TensorPiece& b) { return a.dst_offset < b.dst_offset; });
  uint64_t at = 0;
  for (const TensorPiece& p : loc.pieces) {
    const std::string& path = paths[p.rank];
    const TensorEntry& e = headers[p.rank]->tensors[p.entry];
    if (p.src_offset > e.nbytes || p.length > e.nbytes - p.src_offset) {
      Fail(ErrorCode::kDataLoss, path + ": tensor \"" + loc.name + "\": piece [" +
                                     std::to_string(p.src_offset) + ", +" +
                                     std::to_string(p.length) + ") lies outside entry \"" +
                                     e.name + "\" of " + std::to_string(e.nbytes) + " bytes");
    }
    if (p.dst_offset != at) {
      Fail(ErrorCode::kDataLoss,
           path + ": tensor \"" + loc.name + "\": " +
               (p.dst_offset < at ? "bytes " + std::to_string(p.dst_offset) + ".." +
                                        std::to_string(at) + " are held twice"
                                  : "bytes " + std::to_string(at) + ".." +
                                        std::to_string(p.dst_offset) + " are held by no rank"));
    }
    at = CheckedAdd(at, p.length, path + ": tensor \"" + loc.name + "\" pieces");
  }
  if (at != loc.nbytes) {
    Fail(ErrorCode::kDataLoss, paths[0] + ": tensor \"" + loc.name + "\": the ranks hold " +
                                   std::to_string(at) + " of its " + std::to_string(loc.nbytes) +
                                   " bytes");
  }
}

std::vector<TensorLocation> DescribeLayoutTensors(const std::vector<const RankFileHeader*>& headers,
                                                  const std::vector<std::string>& paths) {
  if (headers.empty() || paths.size() != headers.size()) {
    Fail(ErrorCode::kInvalidArgument, "DescribeLayoutTensors: no rank file headers");
  }
  const RankFileHeader& h0 = *headers[0];
  std::vector<std::unordered_map<std::string_view, size_t>> index(headers.size());
  for (size_t r = 0; r < headers.size(); ++r) {
    const RankFileHeader& h = *headers[r];
    if (h.rank != r || h.world_size != headers.size() || h.layout_key != h0.layout_key ||
        h.kind != h0.kind) {
      Fail(ErrorCode::kMismatch,
           paths[r] + ": holds rank " + std::to_string(h.rank) + " of layout " + h.layout_key +
               " (world size " + std::to_string(h.world_size) + "), expected rank " +
               std::to_string(r) + " of " + h0.layout_key + " (world size " +
               std::to_string(headers.size()) + ")");
    }
    for (size_t i = 0; i < h.tensors.size(); ++i) index[r].emplace(h.tensors[i].name, i);
    for (const auto& t : h.tensors) {
      const auto it = index[0].find(t.name);
      if (r > 0 && it == index[0].end()) {
        Fail(ErrorCode::kMismatch, paths[r] + ": tensor \"" + t.name + "\" is not in " + paths[0]);
      }
      const TensorEntry& t0 = h0.tensors[it->second];
      if (t0.dtype != t.dtype || t0.global_shape != t.global_shape) {
        Fail(ErrorCode::kMismatch, paths[r] + ": tensor \"" + t.name +
                                       "\" has another dtype or global shape than in " + paths[0]);
      }
    }
    if (h.tensors.size() != h0.tensors.size()) {
      for (const auto& t : h0.tensors) {
        if (!index[r].count(t.name)) {
          Fail(ErrorCode::kMismatch, paths[r] + ": tensor \"" + t.name + "\" is missing (" +
                                         paths[0] + " has it)");
        }
      }
    }
  }
  std::vector<TensorLocation> out;
  out.reserve(h0.tensors.size());
  DescribeByMaps(headers, paths, out);
  for (TensorLocation& loc : out) CheckTensorPieces(loc, headers, paths);
  return out;
}

}  // namespace reshard
