#include "reshard/plan/layout_tensors.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <unordered_map>

#include "reshard/base/error.h"

namespace reshard {

namespace {

// ---- describing a layout -------------------------------------------------------------------

uint64_t WholeBytes(const std::string& path, const TensorEntry& e) {
  uint64_t numel = 1;
  for (uint64_t d : e.global_shape) numel = CheckedMul(numel, d, path + ": tensor \"" + e.name + "\" global_shape");
  auto n = BytesFor(e.dtype, numel);
  if (!n) {
    Fail(ErrorCode::kDataLoss, path + ": tensor \"" + e.name + "\": " + std::to_string(numel) +
                                   " elements of " + std::string(Name(e.dtype)) +
                                   " are not a whole number of bytes");
  }
  return *n;
}

// FSDP2 (formats/rank-file.md, "FSDP2 shard rule"): rank r holds rows [start, end) of dim 0,
// the contiguous bytes [start·R, end·R); 0-dim tensors are stored whole on every rank.
void DescribeFsdp2(const std::vector<const RankFileHeader*>& headers,
                   const std::vector<std::string>& paths,
                   const std::vector<std::unordered_map<std::string_view, size_t>>& index,
                   std::vector<TensorLocation>& out) {
  const RankFileHeader& h0 = *headers[0];
  for (size_t i = 0; i < h0.tensors.size(); ++i) {
    const TensorEntry& t0 = h0.tensors[i];
    TensorLocation loc;
    loc.name = t0.name;
    loc.dtype = t0.dtype;
    loc.shape = t0.global_shape;
    loc.nbytes = WholeBytes(paths[0], t0);
    if (!t0.sharded) {
      if (t0.nbytes != loc.nbytes) {
        FailField(paths[0], "tensor \"" + t0.name + "\" nbytes", std::to_string(t0.nbytes),
                  std::to_string(loc.nbytes) + " (a tensor stored whole)");
      }
      if (loc.nbytes > 0) loc.pieces.push_back({0, i, 0, 0, loc.nbytes});
      out.push_back(std::move(loc));
      continue;
    }
    const uint64_t rows = loc.shape.empty() ? 0 : loc.shape[0];
    const uint64_t row_bytes = rows ? loc.nbytes / rows : 0;
    if (rows && loc.nbytes % rows != 0) {
      Fail(ErrorCode::kDataLoss, paths[0] + ": tensor \"" + t0.name +
                                     "\": dim-0 rows are not a whole number of bytes");
    }
    for (uint32_t r = 0; r < headers.size(); ++r) {
      const size_t j = r == 0 ? i : index[r].at(t0.name);
      const TensorEntry& e = headers[r]->tensors[j];
      if (!e.sharded || e.rows.end > rows || e.nbytes != e.rows.size() * row_bytes) {
        Fail(ErrorCode::kDataLoss,
             paths[r] + ": tensor \"" + t0.name + "\": rows [" + std::to_string(e.rows.start) +
                 ", " + std::to_string(e.rows.end) + ") of " + std::to_string(e.nbytes) +
                 " bytes do not fit a dim-0 shard of " + std::to_string(rows) + " rows of " +
                 std::to_string(row_bytes) + " bytes");
      }
      if (e.nbytes > 0) loc.pieces.push_back({r, j, 0, e.rows.start * row_bytes, e.nbytes});
    }
    out.push_back(std::move(loc));
  }
}

// FSDP1: each parameter of a flat entry is the part of flat [offset, offset + numel) that
// every rank's shard [r·c, (r+1)·c) holds; whole entries (persistent buffers) are one piece.
// Tensors come in unit construction order, each unit's parameters in flat order.
void DescribeFsdp1(const std::vector<const RankFileHeader*>& headers,
                   const std::vector<std::string>& paths,
                   const std::vector<std::unordered_map<std::string_view, size_t>>& index,
                   std::vector<TensorLocation>& out) {
  const RankFileHeader& h0 = *headers[0];
  const uint64_t ws = headers.size();
  for (size_t i = 0; i < h0.tensors.size(); ++i) {
    const TensorEntry& t0 = h0.tensors[i];
    if (!t0.flat) {
      TensorLocation loc;
      loc.name = t0.name;
      loc.dtype = t0.dtype;
      loc.shape = t0.global_shape;
      loc.nbytes = WholeBytes(paths[0], t0);
      if (t0.sharded || t0.nbytes != loc.nbytes) {
        Fail(ErrorCode::kDataLoss, paths[0] + ": tensor \"" + t0.name +
                                       "\" of an FSDP1 layout is neither a flat parameter nor whole");
      }
      if (loc.nbytes > 0) loc.pieces.push_back({0, i, 0, 0, loc.nbytes});
      out.push_back(std::move(loc));
      continue;
    }
    const FlatInfo& flat = *t0.flat;
    const uint64_t item = Info(t0.dtype).bits / 8;
    const uint64_t c = CeilDiv(flat.numel, ws);
    std::vector<size_t> entry(ws);
    for (uint32_t r = 0; r < ws; ++r) {
      entry[r] = r == 0 ? i : index[r].at(t0.name);
      const TensorEntry& e = headers[r]->tensors[entry[r]];
      if (!e.flat || !(*e.flat == flat) || e.nbytes != c * item) {
        Fail(ErrorCode::kMismatch, paths[r] + ": flat parameter \"" + t0.name +
                                       "\" has another layout than in " + paths[0]);
      }
    }
    for (const FlatParamInfo& p : flat.params) {
      TensorLocation loc;
      loc.name = p.key;
      loc.dtype = t0.dtype;
      loc.shape = p.shape;
      loc.nbytes = CheckedMul(p.numel, item, paths[0] + ": " + p.key);
      for (uint32_t r = 0; r < ws; ++r) {
        const uint64_t a = std::max(p.offset, r * c);
        const uint64_t b = std::min(p.offset + p.numel, (r + 1) * c);
        if (a >= b) continue;
        loc.pieces.push_back({r, entry[r], (a - r * c) * item, (a - p.offset) * item, (b - a) * item});
      }
      out.push_back(std::move(loc));
    }
  }
}

// Whatever the layout kind: the pieces tile [0, nbytes) and stay inside their entries.
void CheckPieces(TensorLocation& loc, const std::vector<const RankFileHeader*>& headers,
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

}  // namespace

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
  switch (h0.kind) {
    case LayoutKind::kFsdp2: DescribeFsdp2(headers, paths, index, out); break;
    case LayoutKind::kFsdp1: DescribeFsdp1(headers, paths, index, out); break;
  }
  for (TensorLocation& loc : out) CheckPieces(loc, headers, paths);
  return out;
}

}  // namespace reshard
