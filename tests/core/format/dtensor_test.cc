// The DTensor element map (reshard/format/dtensor.h) against a brute-force model written from
// torch's source (placement_types.py: Shard._split_tensor, _StridedShard._split_tensor;
// _fsdp_param.py: FSDPParam._init_sharded_param): explicit index lists cut with torch.chunk's
// rule, placement by placement. Meshes 1×N, 2×2, 2×3, 3×2, 2×2×2 and 3×2×1, every placement
// combination of a 2-dim tensor, odd shapes with empty shards; and torch's own doc examples.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/format/dtensor.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {
namespace {

using test::ThrowsError;
using Ids = std::vector<uint64_t>;

// torch.chunk(x, k)[i], empty pieces filled (fill_empty_tensor_to_shards).
Ids Chunk(const Ids& x, uint64_t k, uint64_t i) {
  const uint64_t n = x.size(), c = (n + k - 1) / k;
  const uint64_t lo = std::min(i * c, n), hi = std::min((i + 1) * c, n);
  return Ids(x.begin() + lo, x.begin() + hi);
}

// _StridedShard._split_tensor's piece i.
Ids Strided(const Ids& x, uint64_t sf, uint64_t k, uint64_t i) {
  Ids out;
  for (uint64_t j = 0; j < sf; ++j) {
    Ids part = Chunk(Chunk(x, sf, j), k, i);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

std::vector<Ids> Model(const std::vector<uint64_t>& shape, const DTensorSharding& s,
                       const std::vector<uint32_t>& mesh, const std::vector<uint32_t>& coord) {
  std::vector<Ids> dims(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    for (uint64_t i = 0; i < shape[d]; ++i) dims[d].push_back(i);
  }
  auto apply = [&](size_t m, bool fsdp) {
    const Placement& p = s.placements[m];
    if (p.kind == Placement::Kind::kReplicate) return;
    Ids& x = dims[p.dim];
    x = (fsdp || p.kind == Placement::Kind::kShard) ? Chunk(x, mesh[m], coord[m])
                                                     : Strided(x, p.split_factor, mesh[m], coord[m]);
  };
  for (size_t m = 0; m < mesh.size(); ++m) {
    if (static_cast<int>(m) != s.fsdp_mesh_dim) apply(m, false);
  }
  if (s.fsdp_mesh_dim >= 0) {
    apply(s.fsdp_mesh_dim, true);
    bool empty = false;
    for (const Ids& x : dims) empty |= x.empty();
    if (empty) dims[s.placements[s.fsdp_mesh_dim].dim].clear();  // _get_dim_chunked_size
  }
  return dims;
}

Ids Flatten(const IndexRuns& runs) {
  Ids out;
  for (const IndexRun& r : runs) {
    EXPECT_GT(r.length, 0u);
    for (uint64_t i = 0; i < r.length; ++i) out.push_back(r.start + i);
  }
  return out;
}

std::vector<uint32_t> Coord(const std::vector<uint32_t>& mesh, uint64_t rank) {
  MeshSpec m;
  m.shape = mesh;
  return m.Coordinate(rank);
}

uint64_t Size(const std::vector<uint32_t>& mesh) {
  uint64_t n = 1;
  for (uint32_t s : mesh) n *= s;
  return n;
}

// Every placement a mesh dim can have on a 2-dim tensor (split factors 2 and 3).
std::vector<Placement> Choices() {
  return {Placement::Replicate(),          Placement::Shard(0),
          Placement::Shard(1),             Placement::StridedShard(0, 2),
          Placement::StridedShard(1, 2),   Placement::StridedShard(0, 3),
          Placement::StridedShard(1, 3)};
}

TEST(DTensorMap, EveryPlacementCombinationMatchesTheModel) {
  const std::vector<std::vector<uint32_t>> meshes = {{1, 4}, {4}, {2, 2}, {2, 3}, {3, 2}, {2, 2, 2}, {3, 2, 1}};
  const std::vector<std::vector<uint64_t>> shapes = {{0, 3}, {1, 1}, {5, 3}, {7, 2}, {8, 8}, {13, 6}, {3, 11}};
  const auto choices = Choices();
  uint64_t checked = 0;
  for (const auto& mesh : meshes) {
    std::vector<size_t> pick(mesh.size(), 0);
    while (true) {
      DTensorSharding s;
      for (size_t i : pick) s.placements.push_back(choices[i]);
      for (const auto& shape : shapes) {
        for (uint64_t r = 0; r < Size(mesh); ++r) {
          const auto coord = Coord(mesh, r);
          const auto got = DTensorLocalIndices(shape, s, mesh, coord, "t");
          const auto want = Model(shape, s, mesh, coord);
          ASSERT_EQ(got.size(), want.size());
          const auto counts = DTensorLocalShape(shape, s, mesh, coord, "t");
          for (size_t d = 0; d < got.size(); ++d) {
            ASSERT_EQ(counts[d], want[d].size()) << "DTensorLocalShape, dim " << d;
            ASSERT_EQ(Flatten(got[d]), want[d]) << "mesh dims " << mesh.size() << " rank " << r
                                                << " dim " << d;
          }
          ++checked;
        }
      }
      size_t i = 0;
      while (i < pick.size() && ++pick[i] == choices.size()) pick[i++] = 0;
      if (i == pick.size()) break;
    }
  }
  EXPECT_GT(checked, 10000u);
}

TEST(DTensorMap, ShardsTileTheTensorAndEmptyShardsAreEmpty) {
  // Shard(0) over 4 of 5 rows: 2, 2, 1, 0 (torch.chunk), Shard(1) over 2 of 3 columns: 2, 1.
  const std::vector<uint32_t> mesh = {4, 2};
  DTensorSharding s{{Placement::Shard(0), Placement::Shard(1)}, -1};
  std::vector<std::vector<int>> seen(5, std::vector<int>(3, 0));
  const uint64_t rows[] = {2, 2, 1, 0};
  for (uint64_t r = 0; r < 8; ++r) {
    const auto c = Coord(mesh, r);
    const auto got = DTensorLocalIndices({5, 3}, s, mesh, c, "t");
    EXPECT_EQ(CountOf(got[0]), rows[c[0]]);
    EXPECT_EQ(CountOf(got[1]), c[1] == 0 ? 2u : 1u);
    EXPECT_LE(got[0].size(), 1u);  // a box: one run per dim, none when empty
    for (uint64_t i : Flatten(got[0])) {
      for (uint64_t j : Flatten(got[1])) ++seen[i][j];
    }
  }
  for (const auto& row : seen) {
    for (int v : row) EXPECT_EQ(v, 1);
  }
}

TEST(DTensorMap, TorchDocExamples) {
  // placement_types.py, _StridedShard's docstring: [8, 8], mesh [[0, 1], [2, 3]] ("dp", "tp").
  const std::vector<uint32_t> mesh = {2, 2};
  DTensorSharding shard{{Placement::Shard(0), Placement::Shard(0)}, -1};
  DTensorSharding strided{{Placement::StridedShard(0, 2), Placement::Shard(0)}, -1};
  const uint64_t by_shard[] = {0, 2, 4, 6}, by_strided[] = {0, 4, 2, 6};  // first row per rank
  for (uint64_t r = 0; r < 4; ++r) {
    const auto a = DTensorLocalIndices({8, 8}, shard, mesh, Coord(mesh, r), "t");
    const auto b = DTensorLocalIndices({8, 8}, strided, mesh, Coord(mesh, r), "t");
    EXPECT_EQ(a[0], (IndexRuns{{by_shard[r], 2}}));
    EXPECT_EQ(b[0], (IndexRuns{{by_strided[r], 2}}));
    EXPECT_EQ(a[1], (IndexRuns{{0, 8}}));
  }
  // _StridedShard alone: dp coordinate 0 of _S(0, 2) holds rows 0, 1, 4, 5: two runs.
  DTensorSharding alone{{Placement::StridedShard(0, 2)}, -1};
  EXPECT_EQ(DTensorLocalIndices({8, 8}, alone, {2}, {0}, "t")[0], (IndexRuns{{0, 2}, {4, 2}}));
}

TEST(DTensorMap, FullyShardAppliesItsChunkLast) {
  // 7 rows, dp 3 × tp 2, TP Shard(0): fully_shard records _S(0, 2) on dp, but chunks the TP
  // shard (rows 0-3 on tp 0, 4-6 on tp 1) into 3: 0-1, 2-3, none and 4, 5, 6; so (2, 0)
  // holds nothing and (2, 1) row 6. Left to right, _S(0, 2) gives dp 2 row 6, which tp 0 keeps.
  const std::vector<uint32_t> mesh = {3, 2};
  DTensorSharding fsdp{{Placement::StridedShard(0, 2), Placement::Shard(0)}, 0};
  DTensorSharding left{{Placement::StridedShard(0, 2), Placement::Shard(0)}, -1};
  EXPECT_EQ(DTensorLocalIndices({7, 4}, fsdp, mesh, {2, 0}, "t")[0], IndexRuns{});
  EXPECT_EQ(DTensorLocalIndices({7, 4}, fsdp, mesh, {2, 1}, "t")[0], (IndexRuns{{6, 1}}));
  EXPECT_EQ(DTensorLocalIndices({7, 4}, left, mesh, {2, 0}, "t")[0], (IndexRuns{{6, 1}}));
  EXPECT_EQ(DTensorLocalIndices({7, 4}, left, mesh, {2, 1}, "t")[0], IndexRuns{});
  // FSDP Shard(1) over a TP Shard(0) (split factor 1: different dims commute).
  DTensorSharding cols{{Placement::Shard(1), Placement::Shard(0)}, 0};
  const auto c = DTensorLocalIndices({6, 4}, cols, {2, 2}, {1, 0}, "t");
  EXPECT_EQ(c[0], (IndexRuns{{0, 3}}));
  EXPECT_EQ(c[1], (IndexRuns{{2, 2}}));
  // The brute-force model agrees on every fsdp case of every mesh and shape as well.
  for (const auto& m : std::vector<std::vector<uint32_t>>{{2, 2}, {3, 2}, {2, 3}, {4, 2}, {2, 2, 2}}) {
    for (uint64_t n = 0; n < 20; ++n) {
      DTensorSharding s;
      s.fsdp_mesh_dim = 0;
      uint64_t others = 1;
      for (size_t i = 1; i < m.size(); ++i) {
        s.placements.push_back(Placement::Shard(0));
        others *= m[i];
      }
      s.placements.insert(s.placements.begin(), Placement::StridedShard(0, others));
      for (uint64_t r = 0; r < Size(m); ++r) {
        const auto coord = Coord(m, r);
        EXPECT_EQ(Flatten(DTensorLocalIndices({n, 3}, s, m, coord, "t")[0]), Model({n, 3}, s, m, coord)[0]);
        EXPECT_EQ(DTensorLocalShape({n, 3}, s, m, coord, "t")[0], Model({n, 3}, s, m, coord)[0].size());
      }
    }
  }
}

TEST(DTensorMap, HsdpAndExpertParallelFsdpDimsMatchTheModel) {
  // HSDP over TP: (replicate, shard, tp), fully_shard's dim is mesh dim 1, Replicate on 0
  // (FSDPParam: (Replicate(),) + dp_shard_tp_placement). EP + TP experts [E, H, I] on
  // (dp_shard, ep, tp): EP Shard(0), TP Shard(2), fully_shard Shard(1) (shard_placement_fn).
  struct Case {
    std::vector<uint32_t> mesh;
    DTensorSharding s;
    std::vector<uint64_t> shape;
  };
  const std::vector<Case> cases = {
      {{2, 3, 2}, {{Placement::Replicate(), Placement::StridedShard(0, 2), Placement::Shard(0)}, 1}, {11, 4}},
      {{2, 3, 2}, {{Placement::Replicate(), Placement::Shard(0), Placement::Shard(1)}, 1}, {7, 5}},
      {{3, 2, 2}, {{Placement::Shard(1), Placement::Shard(0), Placement::Shard(2)}, 0}, {5, 7, 6}},
      {{2, 2, 3}, {{Placement::StridedShard(0, 6), Placement::Shard(0), Placement::Shard(0)}, 0}, {13, 3, 2}},
  };
  for (const Case& c : cases) {
    for (uint64_t r = 0; r < Size(c.mesh); ++r) {
      const auto coord = Coord(c.mesh, r);
      const auto got = DTensorLocalIndices(c.shape, c.s, c.mesh, coord, "t");
      const auto want = Model(c.shape, c.s, c.mesh, coord);
      for (size_t d = 0; d < c.shape.size(); ++d) EXPECT_EQ(Flatten(got[d]), want[d]) << "rank " << r;
      EXPECT_EQ(DTensorLocalShape(c.shape, c.s, c.mesh, coord, "t")[0], want[0].size());
    }
  }
}

TEST(DTensorMap, BigShardOneIsOneRunPerDim) {
  // [128256, 4096] Shard(1) over tp 8: no per-row anything.
  DTensorSharding s{{Placement::Replicate(), Placement::Shard(1)}, -1};
  const auto got = DTensorLocalIndices({128256, 4096}, s, {2, 8}, {1, 3}, "t");
  EXPECT_EQ(got[0], (IndexRuns{{0, 128256}}));
  EXPECT_EQ(got[1], (IndexRuns{{1536, 512}}));
}

TEST(DTensorMap, HugeDimsAndSplitFactorsCostNoMoreThanTheirPieces) {
  // _S(0, 2^20) of 3 rows: 3 pieces visited, not 2^20; a dim near 2^64 does not overflow.
  DTensorSharding s{{Placement::StridedShard(0, 1u << 20)}, -1};
  EXPECT_EQ(DTensorLocalIndices({3}, s, {2}, {0}, "t")[0], (IndexRuns{{0, 3}}));
  DTensorSharding big{{Placement::Shard(0)}, -1};
  const uint64_t n = ~uint64_t{0} - 1;
  EXPECT_EQ(DTensorLocalIndices({n}, big, {3}, {2}, "t")[0], (IndexRuns{{2 * CeilDiv(n, 3), n - 2 * CeilDiv(n, 3)}}));
  EXPECT_EQ(DTensorLocalShape({n}, big, {3}, {2}, "t")[0], n - 2 * CeilDiv(n, 3));
  EXPECT_FALSE(ParsePlacement("_S(0,1048577)"));
}

TEST(DTensorMap, RefusesShardingsThatDoNotFit) {
  EXPECT_TRUE(ThrowsError([] { DTensorLocalIndices({4}, {{Placement::Shard(0)}, -1}, {2, 2}, {0, 0}, "w"); },
                          ErrorCode::kInvalidArgument, {"w", "1 placements", "2 dims"}));
  EXPECT_TRUE(ThrowsError([] { DTensorLocalIndices({4}, {{Placement::Shard(1)}, -1}, {2}, {0}, "w"); },
                          ErrorCode::kInvalidArgument, {"S(1)", "1-dim tensor"}));
  EXPECT_TRUE(ThrowsError(
      [] {
        DTensorLocalIndices({4, 4}, {{Placement::StridedShard(0, 3), Placement::Shard(0)}, 0}, {2, 2},
                            {0, 0}, "w");
      },
      ErrorCode::kInvalidArgument, {"_S(0,3)", "into 2", "_S(0,2)"}));
  EXPECT_TRUE(ThrowsError([] { DTensorLocalIndices({4}, {{Placement::Replicate()}, 0}, {2}, {0}, "w"); },
                          ErrorCode::kInvalidArgument, {"fsdp_mesh_dim 0"}));
}

TEST(DTensorMap, PlacementAndMeshText) {
  for (const Placement& p : Choices()) EXPECT_EQ(ParsePlacement(p.ToString()), p);
  EXPECT_EQ(ParsePlacement("_S(0, 2)"), Placement::StridedShard(0, 2));
  for (const char* bad : {"", "S", "S()", "S(-1)", "S(01)", "_S(0)", "_S(0,0)", "Shard(0)", "r"}) {
    EXPECT_FALSE(ParsePlacement(bad)) << bad;
  }
  const MeshSpec m = ParseMeshFlag("dp_shard=2,tp=3");
  EXPECT_EQ(m.names, (std::vector<std::string>{"dp_shard", "tp"}));
  EXPECT_EQ(m.shape, (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(m.Flag(), "dp_shard=2,tp=3");
  EXPECT_EQ(m.KeyPart(), "dp_shard2.tp3");
  EXPECT_EQ(m.Coordinate(4), (std::vector<uint32_t>{1, 1}));  // row-major, as DeviceMesh
  for (const char* bad : {"", "dp", "dp=0", "dp=2,dp=2", "dp=2,", "1x=2", "dp=-1", "d p=2"}) {
    EXPECT_TRUE(ThrowsError([&] { ParseMeshFlag(bad); }, ErrorCode::kInvalidArgument, {"--mesh"})) << bad;
  }
}

// A DTensor rank file header: rank 2 of dp_shard=2,tp=2, coordinate (1, 0).
RankFileHeader DTensorHeader() {
  RankFileHeader h;
  LayoutSpec l;
  l.kind = LayoutKind::kDTensor;
  l.mesh = ParseMeshFlag("dp_shard=2,tp=2");
  l.plan_name = "llama_tp";
  l.plan_xxh3 = 0x0123456789abcdefull;
  l.Normalize();
  h.SetLayout(l);
  h.rank = 2;
  h.source = SourceFingerprint::FromSaved({0x42, 7});
  TensorEntry t;
  t.name = "w";
  t.dtype = DType::kF32;
  t.global_shape = {7, 6};
  t.dtensor = DTensorSharding{{Placement::StridedShard(0, 2), Placement::Shard(0)}, 0, {2, 2}};
  t.local_shape = {2, 6};  // TP rows 0-3, FSDP's second half: rows 2-3
  t.nbytes = t.stored_size = 48;
  t.chunk_xxh3 = {Xxh3("x")};
  t.xxh3 = CombineChunkChecksums(t.chunk_xxh3);
  h.tensors.push_back(t);
  return h;
}

TEST(DTensorHeader, RoundTripsAndRecordsMeshCoordinateAndPlacements) {
  const RankFileHeader h = DTensorHeader();
  EXPECT_EQ(h.layout_key, "dtensor-dp_shard2.tp2-llama_tp.01234567");
  const std::string text = SerializeHeader(h);
  for (const char* needle : {R"J("coordinate": [)J", R"J("placements": [)J", R"J("_S(0,2)")J", R"J("fsdp_mesh_dim": 0)J",
                             R"J("names": [)J", R"J("xxh3": "0123456789abcdef")J", R"J("kind": "dtensor")J"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
  }
  const RankFileHeader back = ParseHeader(text, 4096, "r.reshard");
  EXPECT_EQ(back.mesh, h.mesh);
  EXPECT_EQ(back.plan_name, "llama_tp");
  EXPECT_EQ(back.plan_xxh3, h.plan_xxh3);
  EXPECT_EQ(back.Layout().Key(), h.layout_key);
  ASSERT_EQ(back.tensors.size(), 1u);
  EXPECT_EQ(back.tensors[0].dtensor, h.tensors[0].dtensor);
  EXPECT_EQ(SerializeHeader(back), text);
}

TEST(DTensorHeader, RefusesFieldsThatDisagree) {
  const std::string text = SerializeHeader(DTensorHeader());
  auto broken = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  struct Case {
    std::string from, to;
    std::vector<std::string_view> needles;
  };
  const std::vector<Case> cases = {
      {R"J("local_shape": [
    2,)J", R"J("local_shape": [
    3,)J", {"r.reshard", "local_shape", "[3, 6]", "[2, 6]", "coordinate [1, 0]"}},
      {R"J("_S(0,2)")J", R"J("S(0)")J", {"r.reshard", "_S(0,2)"}},
      {R"J("_S(0,2)")J", R"J("Shard(0)")J", {"placements[0]", "Shard(0)", "_S(d,k)"}},
      {R"J("fsdp_mesh_dim": 0)J", R"J("fsdp_mesh_dim": 2)J", {"fsdp_mesh_dim", "2"}},
      {R"J("shard": null)J", R"J("shard": {"dim": 0, "start": 0, "end": 2})J", {".shard", "null in a dtensor layout"}},
      {R"J("world_size": 4)J", R"J("world_size": 6)J", {"layout.mesh", "world_size 6"}},
  };
  for (const Case& c : cases) {
    const std::string t = broken(c.from, c.to);
    std::vector<std::string_view> needles = c.needles;
    std::string message;
    try {
      ParseHeader(t, 4096, "r.reshard");
      ADD_FAILURE() << "accepted: " << c.to;
    } catch (const Error& e) {
      message = e.what();
      EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << message;
      for (std::string_view n : needles) EXPECT_NE(message.find(n), std::string::npos) << n << " in " << message;
    }
  }
  // The coordinate must be the rank's, row-major.
  std::string t = text;
  const size_t at = t.find(R"J("coordinate": [)J");
  const size_t one = t.find('1', at);
  t[one] = '0';
  EXPECT_TRUE(ThrowsError([&] { ParseHeader(t, 4096, "r.reshard"); }, ErrorCode::kDataLoss,
                          {"coordinate", "[1, 0]", "rank 2"}));
}

}  // namespace
}  // namespace reshard
