#include "reshard/format/dtensor.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <set>

#include "reshard/base/error.h"

namespace reshard {

std::string Placement::ToString() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")";
    case Kind::kStridedShard:
      return "_S(" + std::to_string(dim) + "," + std::to_string(split_factor) + ")";
  }
  return "?";
}

namespace {

// A decimal number without sign or leading zeros (but "0"); nullopt otherwise.
std::optional<uint64_t> Decimal(std::string_view s) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

bool IsName(std::string_view s) {
  if (s.empty() || s.size() > 64 || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  }
  return true;
}

}  // namespace

std::optional<Placement> ParsePlacement(std::string_view t) {
  if (t == "R") return Placement::Replicate();
  auto inner = [&](std::string_view prefix) -> std::optional<std::string_view> {
    if (t.size() < prefix.size() + 1 || t.substr(0, prefix.size()) != prefix || t.back() != ')') {
      return std::nullopt;
    }
    return t.substr(prefix.size(), t.size() - prefix.size() - 1);
  };
  if (auto in = inner("S(")) {
    auto d = Decimal(*in);
    if (!d || *d > 64) return std::nullopt;
    return Placement::Shard(static_cast<uint32_t>(*d));
  }
  if (auto in = inner("_S(")) {
    const size_t comma = in->find(',');
    if (comma == std::string_view::npos) return std::nullopt;
    std::string_view sf = in->substr(comma + 1);
    if (!sf.empty() && sf[0] == ' ') sf.remove_prefix(1);
    auto d = Decimal(in->substr(0, comma));
    auto k = Decimal(sf);
    if (!d || *d > 64 || !k || *k == 0 || *k > (1u << 20)) return std::nullopt;
    return Placement::StridedShard(static_cast<uint32_t>(*d), *k);
  }
  return std::nullopt;
}

uint64_t MeshSpec::Size() const {
  uint64_t n = 1;
  for (uint32_t s : shape) n = CheckedMul(n, s, "mesh size");
  return n;
}

std::string MeshSpec::Flag() const {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? "," : "") + names[i] + "=" + std::to_string(shape[i]);
  }
  return s;
}

std::string MeshSpec::KeyPart() const {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "." : "") + names[i] + std::to_string(shape[i]);
  return s;
}

std::vector<uint32_t> MeshSpec::Coordinate(uint64_t rank) const {
  std::vector<uint32_t> c(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    c[i] = static_cast<uint32_t>(rank % shape[i]);
    rank /= shape[i];
  }
  return c;
}

int MeshSpec::Find(std::string_view name) const {
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<int>(i);
  }
  return -1;
}

void MeshSpec::Check(const std::string& what) const {
  if (shape.empty() || shape.size() > 8 || names.size() != shape.size()) {
    Fail(ErrorCode::kInvalidArgument, what + ": a mesh of " + std::to_string(names.size()) +
                                          " names and " + std::to_string(shape.size()) +
                                          " sizes, expected 1 to 8 named dims");
  }
  std::set<std::string> seen;
  uint64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (!IsName(names[i])) {
      Fail(ErrorCode::kInvalidArgument, what + ": mesh dim name \"" + Printable(names[i]) +
                                            "\" is not a name ([A-Za-z_][A-Za-z0-9_]*, ≤ 64)");
    }
    if (!seen.insert(names[i]).second) {
      Fail(ErrorCode::kInvalidArgument, what + ": mesh dim name \"" + names[i] + "\" twice");
    }
    if (shape[i] == 0) {
      Fail(ErrorCode::kInvalidArgument, what + ": mesh dim " + names[i] + " of size 0");
    }
    n *= shape[i];
    if (n > (1u << 20)) {
      Fail(ErrorCode::kInvalidArgument, what + ": a mesh of more than 2^20 ranks");
    }
  }
}

MeshSpec ParseMeshFlag(std::string_view text) {
  MeshSpec m;
  size_t at = 0;
  while (at <= text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view item = text.substr(at, comma - at);
    const size_t eq = item.find('=');
    auto size = eq == std::string_view::npos ? std::nullopt : Decimal(item.substr(eq + 1));
    if (!size || *size == 0 || *size > (1u << 20)) {
      Fail(ErrorCode::kInvalidArgument, "--mesh " + Printable(text) + ": \"" + Printable(item) +
                                            "\" is not NAME=SIZE (e.g. dp_shard=2,tp=2)");
    }
    m.names.emplace_back(item.substr(0, eq));
    m.shape.push_back(static_cast<uint32_t>(*size));
    at = comma + 1;
  }
  m.Check("--mesh " + Printable(text));
  return m;
}

uint64_t CountOf(const IndexRuns& runs) {
  uint64_t n = 0;
  for (const IndexRun& r : runs) n += r.length;
  return n;
}

namespace {

// Positions [lo, hi) of the ordered list `runs`, appended to `out`.
void AppendSlice(const IndexRuns& runs, uint64_t lo, uint64_t hi, IndexRuns& out) {
  uint64_t at = 0;  // position of the current run's first index
  for (const IndexRun& r : runs) {
    const uint64_t a = std::max(lo, at), b = std::min(hi, at + r.length);
    if (a < b) {
      const uint64_t start = r.start + (a - at);
      if (!out.empty() && out.back().start + out.back().length == start) {
        out.back().length += b - a;
      } else {
        out.push_back({start, b - a});
      }
    }
    at += r.length;
    if (at >= hi) break;
  }
}

// torch.chunk's piece i of k over n positions: [min(i·c, n), min((i+1)·c, n)), c = ceil(n/k)
// (saturating: (i+1)·c may pass 2^64 when n is near it).
std::pair<uint64_t, uint64_t> ChunkOf(uint64_t n, uint64_t k, uint64_t i) {
  const uint64_t c = CeilDiv(n, k);
  auto at = [&](uint64_t j) {
    uint64_t v;
    return __builtin_mul_overflow(j, c, &v) ? n : std::min(v, n);
  };
  return {at(i), at(i + 1)};
}

// Shard(d) with k pieces, piece i: Shard._split_tensor (torch.chunk, empty pieces filled).
IndexRuns ShardRuns(const IndexRuns& runs, uint64_t k, uint64_t i) {
  const auto [lo, hi] = ChunkOf(CountOf(runs), k, i);
  IndexRuns out;
  AppendSlice(runs, lo, hi, out);
  return out;
}

// _StridedShard(d, sf) with k pieces, piece i (_StridedShard._split_tensor): torch.chunk into
// sf pieces, each into k, the i-th of each concatenated.
IndexRuns StridedRuns(const IndexRuns& runs, uint64_t sf, uint64_t k, uint64_t i) {
  const uint64_t n = CountOf(runs);
  IndexRuns out;
  for (uint64_t j = 0; j < sf; ++j) {
    const auto [plo, phi] = ChunkOf(n, sf, j);
    if (plo >= n) break;  // the rest are empty: at most min(sf, n) pieces
    const auto [lo, hi] = ChunkOf(phi - plo, k, i);
    AppendSlice(runs, plo + lo, plo + hi, out);
  }
  return out;
}

}  // namespace

namespace {

// The checks DTensorLocalIndices and DTensorLocalShape share.
void CheckSharding(const std::vector<uint64_t>& global_shape, const DTensorSharding& s,
                   const std::vector<uint32_t>& mesh_shape, const std::vector<uint32_t>& coordinate,
                   const std::string& what) {
  const size_t nd = mesh_shape.size();
  if (s.placements.size() != nd || coordinate.size() != nd) {
    Fail(ErrorCode::kInvalidArgument, what + ": " + std::to_string(s.placements.size()) +
                                          " placements for a mesh of " + std::to_string(nd) +
                                          " dims");
  }
  for (size_t m = 0; m < nd; ++m) {
    const Placement& p = s.placements[m];
    if (coordinate[m] >= mesh_shape[m]) {
      Fail(ErrorCode::kInvalidArgument, what + ": coordinate " + std::to_string(coordinate[m]) +
                                            " outside mesh dim " + std::to_string(m) + " of size " +
                                            std::to_string(mesh_shape[m]));
    }
    if (p.IsShard() && p.dim >= global_shape.size()) {
      Fail(ErrorCode::kInvalidArgument, what + ": placement " + p.ToString() + " on mesh dim " +
                                            std::to_string(m) + " of a " +
                                            std::to_string(global_shape.size()) + "-dim tensor");
    }
    if (p.kind == Placement::Kind::kStridedShard && p.split_factor == 0) {
      Fail(ErrorCode::kInvalidArgument, what + ": split_factor 0");
    }
  }
  const int f = s.fsdp_mesh_dim;
  if (f >= 0) {
    if (static_cast<size_t>(f) >= nd || !s.placements[f].IsShard()) {
      Fail(ErrorCode::kInvalidArgument, what + ": fsdp_mesh_dim " + std::to_string(f) +
                                            " is not a mesh dim with a Shard placement");
    }
    // fully_shard records _StridedShard(d, num_shards_map[d]) when the TP placements shard d.
    const Placement& p = s.placements[f];
    uint64_t others = 1;
    for (size_t m = 0; m < nd; ++m) {
      if (static_cast<int>(m) != f && s.placements[m].IsShard() && s.placements[m].dim == p.dim) {
        others *= mesh_shape[m];
      }
    }
    const uint64_t sf = p.kind == Placement::Kind::kStridedShard ? p.split_factor : 1;
    if (sf != others) {
      Fail(ErrorCode::kInvalidArgument,
           what + ": fsdp mesh dim " + std::to_string(f) + " has " + p.ToString() +
               ", but the other mesh dims cut tensor dim " + std::to_string(p.dim) + " into " +
               std::to_string(others) + " (fully_shard would record " +
               (others > 1 ? Placement::StridedShard(p.dim, others) : Placement::Shard(p.dim)).ToString() +
               ")");
    }
  }
}

// How many of n positions piece i of _StridedShard(sf) over k keeps (only n matters).
uint64_t StridedCount(uint64_t n, uint64_t sf, uint64_t k, uint64_t i) {
  if (n == 0) return 0;
  const uint64_t c1 = CeilDiv(n, sf);  // sizes of the first split: full pieces of c1, one rest
  const uint64_t full = n / c1, rest = n % c1;
  auto piece = [&](uint64_t m) {
    const auto [lo, hi] = ChunkOf(m, k, i);
    return hi - lo;
  };
  return full * piece(c1) + piece(rest);
}

}  // namespace

std::vector<uint64_t> DTensorLocalShape(const std::vector<uint64_t>& global_shape,
                                        const DTensorSharding& s,
                                        const std::vector<uint32_t>& mesh_shape,
                                        const std::vector<uint32_t>& coordinate,
                                        const std::string& what) {
  CheckSharding(global_shape, s, mesh_shape, coordinate, what);
  std::vector<uint64_t> n = global_shape;
  const int f = s.fsdp_mesh_dim;
  auto apply = [&](size_t m, bool as_shard) {
    const Placement& p = s.placements[m];
    if (!p.IsShard()) return;
    uint64_t& x = n[p.dim];
    if (as_shard || p.kind == Placement::Kind::kShard) {
      const auto [lo, hi] = ChunkOf(x, mesh_shape[m], coordinate[m]);
      x = hi - lo;
    } else {
      x = StridedCount(x, p.split_factor, mesh_shape[m], coordinate[m]);
    }
  };
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    if (static_cast<int>(m) != f) apply(m, false);
  }
  if (f >= 0) {
    apply(static_cast<size_t>(f), true);
    if (std::find(n.begin(), n.end(), 0u) != n.end()) n[s.placements[f].dim] = 0;
  }
  return n;
}

std::vector<IndexRuns> DTensorLocalIndices(const std::vector<uint64_t>& global_shape,
                                           const DTensorSharding& s,
                                           const std::vector<uint32_t>& mesh_shape,
                                           const std::vector<uint32_t>& coordinate,
                                           const std::string& what) {
  CheckSharding(global_shape, s, mesh_shape, coordinate, what);
  const size_t nd = mesh_shape.size();
  const int f = s.fsdp_mesh_dim;
  std::vector<IndexRuns> dims(global_shape.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    if (global_shape[d]) dims[d].push_back({0, global_shape[d]});
  }
  auto apply = [&](size_t m, bool as_shard) {
    const Placement& p = s.placements[m];
    if (!p.IsShard()) return;
    IndexRuns& r = dims[p.dim];
    if (as_shard || p.kind == Placement::Kind::kShard) {
      r = ShardRuns(r, mesh_shape[m], coordinate[m]);
    } else {
      r = StridedRuns(r, p.split_factor, mesh_shape[m], coordinate[m]);
    }
  };
  for (size_t m = 0; m < nd; ++m) {
    if (static_cast<int>(m) != f) apply(m, false);
  }
  if (f >= 0) {
    apply(static_cast<size_t>(f), true);
    // FSDPParam.sharded_size (_get_dim_chunked_size): a chunk of no elements has size 0 on the
    // shard dim, even when another dim is what made it empty (an empty TP shard).
    for (const IndexRuns& r : dims) {
      if (r.empty()) dims[s.placements[f].dim].clear();
    }
  }
  return dims;
}

}  // namespace reshard
