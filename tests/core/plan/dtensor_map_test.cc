// The byte map of DTensor entries (reshard/plan/byte_map.h: MapEntry's DTensor case,
// DTensorSegments, kStrided segments): few segments for boxes, fills equal to the elements of
// the element map (reshard/format/dtensor.h) gathered by hand, with and without dtype
// conversion, in any pieces; reads bounded by a small multiple of the piece; the inverse
// (DescribeLayoutTensors) tiles every tensor once over a mesh with replicated dims; parallel
// plans (reshard/format/parallel_plan.h) parsed, refused with clear errors, and applied as
// fully_shard records placements.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/format/parallel_plan.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/layout_tensors.h"

namespace reshard {
namespace {

using test::ThrowsError;

// One F32 source tensor `w` (element i holds i) in an in-memory file; reads are counted.
struct Source {
  std::vector<float> values;
  SourceTensor t;
  mutable uint64_t reads = 0, read_bytes = 0, largest = 0;

  explicit Source(std::vector<uint64_t> shape) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    values.resize(n);
    for (uint64_t i = 0; i < n; ++i) values[i] = static_cast<float>(i);
    t.name = "w";
    t.dtype = DType::kF32;
    t.shape = std::move(shape);
    t.offset = 0;
    t.nbytes = n * 4;
  }
  SourceLookup Lookup() const {
    return [this](std::string_view n) -> const SourceTensor* { return n == "w" ? &t : nullptr; };
  }
  SourceRead Read() const {
    return [this](size_t, uint64_t at, size_t n, void* dst) {
      ASSERT_LE(at + n, values.size() * 4);
      std::memcpy(dst, reinterpret_cast<const char*>(values.data()) + at, n);
      ++reads;
      read_bytes += n;
      largest = std::max<uint64_t>(largest, n);
    };
  }
};

TensorEntry Entry(const std::vector<uint64_t>& shape, DTensorSharding s, uint32_t rank, DType dtype = DType::kF32) {
  TensorEntry e;
  e.name = "w";
  e.dtype = dtype;
  e.global_shape = shape;
  MeshSpec mesh;
  mesh.shape = s.mesh_shape;
  for (const IndexRuns& r : DTensorLocalIndices(shape, s, s.mesh_shape, mesh.Coordinate(rank), "w")) {
    e.local_shape.push_back(CountOf(r));
  }
  uint64_t n = 1;
  for (uint64_t d : e.local_shape) n *= d;
  e.nbytes = n * Info(dtype).bits / 8;
  e.dtensor = std::move(s);
  return e;
}

uint32_t World(const DTensorSharding& s) {
  uint32_t n = 1;
  for (uint32_t v : s.mesh_shape) n *= v;
  return n;
}

// The local tensor's elements by the element map, gathered one by one (row-major odometer).
std::vector<float> Expected(const std::vector<uint64_t>& shape, const DTensorSharding& s, uint32_t rank) {
  MeshSpec mesh;
  mesh.shape = s.mesh_shape;
  const auto dims = DTensorLocalIndices(shape, s, s.mesh_shape, mesh.Coordinate(rank), "w");
  std::vector<std::vector<uint64_t>> ids(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    for (const IndexRun& r : dims[d]) {
      for (uint64_t i = 0; i < r.length; ++i) ids[d].push_back(r.start + i);
    }
    if (ids[d].empty()) return {};
  }
  std::vector<float> out;
  std::vector<size_t> at(dims.size(), 0);
  while (true) {
    uint64_t flat = 0;
    for (size_t d = 0; d < dims.size(); ++d) flat = flat * shape[d] + ids[d][at[d]];
    out.push_back(static_cast<float>(flat));
    size_t d = dims.size();
    while (d > 0 && ++at[d - 1] == ids[d - 1].size()) at[--d] = 0;
    if (d == 0) break;
  }
  return out;
}

std::vector<DTensorSharding> Shardings() {
  using P = Placement;
  return {
      {{P::Shard(0)}, -1, {3}},
      {{P::Replicate(), P::Shard(1)}, -1, {2, 4}},
      {{P::Shard(0), P::Shard(1)}, -1, {2, 3}},
      {{P::StridedShard(0, 2), P::Shard(0)}, 0, {3, 2}},
      {{P::Shard(1), P::StridedShard(1, 2)}, -1, {2, 2}},
      {{P::StridedShard(2, 3), P::Shard(0), P::Shard(1)}, -1, {2, 2, 2}},
      {{P::Shard(2), P::Replicate(), P::Shard(0)}, -1, {2, 2, 2}},
      {{P::Shard(1), P::Shard(2)}, -1, {2, 3}},
  };
}

TEST(DTensorByteMap, FillsTheElementMapsElementsInAnyPieces) {
  for (const std::vector<uint64_t>& shape : std::vector<std::vector<uint64_t>>{{7, 5, 6}, {4, 9, 3}, {1, 2, 5}}) {
    Source src(shape);
    for (const DTensorSharding& s : Shardings()) {
      for (uint32_t r = 0; r < World(s); ++r) {
        const TensorEntry e = Entry(shape, s, r);
        const EntryMap m = MapEntry(e, LayoutKind::kDTensor, World(s), r, "f");
        ASSERT_EQ(CheckSources(m, src.Lookup()), "");
        const std::vector<float> want = Expected(shape, s, r);
        ASSERT_EQ(want.size() * 4, e.nbytes);
        std::vector<char> scratch;
        // Whole, then in pieces of 7 bytes (cutting elements) and of 12 bytes (whole elements).
        for (uint64_t piece : {e.nbytes, uint64_t{7}, uint64_t{12}}) {
          if (piece == 0) continue;
          std::vector<float> got(want.size(), -1.0f);
          for (uint64_t at = 0; at < e.nbytes; at += piece) {
            const uint64_t n = std::min(piece, e.nbytes - at);
            FillEntry(m, src.Lookup(), src.Read(), at, n, reinterpret_cast<char*>(got.data()) + at, scratch);
          }
          ASSERT_EQ(got, want) << "rank " << r << " piece " << piece;
        }
        // Converted to BF16: the same elements, each rounded as Tensor.to().
        const TensorEntry b = Entry(shape, s, r, DType::kBF16);
        const EntryMap mb = MapEntry(b, LayoutKind::kDTensor, World(s), r, "f");
        std::vector<uint16_t> want_bf16(want.size()), got_bf16(want.size());
        ConvertElements(DType::kF32, DType::kBF16, want.data(), want_bf16.data(), want.size());
        for (uint64_t at = 0; at < b.nbytes; at += 6) {
          FillEntry(mb, src.Lookup(), src.Read(), at, std::min<uint64_t>(6, b.nbytes - at),
                    reinterpret_cast<char*>(got_bf16.data()) + at, scratch);
        }
        ASSERT_EQ(got_bf16, want_bf16);
        // Every byte described by the element it holds; FirstSourceByte its first element.
        for (uint64_t i = 0; i < want.size(); ++i) {
          EXPECT_EQ(DescribeEntryByte(m, i * 4),
                    "element " + std::to_string(static_cast<uint64_t>(want[i])) + " of source tensor w");
          EXPECT_EQ(FirstSourceByte(m, src.Lookup(), i * 4).second, static_cast<uint64_t>(want[i]) * 4);
        }
      }
    }
  }
}

TEST(DTensorByteMap, BoxesAreFewSegments) {
  using P = Placement;
  auto segments = [](const std::vector<uint64_t>& shape, DTensorSharding s, uint32_t rank) {
    const TensorEntry e = Entry(shape, s, rank, DType::kBF16);
    return MapEntry(e, LayoutKind::kDTensor, World(s), rank, "f").segments;
  };
  // [128256, 4096] Shard(1) over tp 8: one strided segment of 128256 rows.
  auto s = segments({128256, 4096}, {{P::Replicate(), P::Shard(1)}, -1, {2, 8}}, 11);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].kind, EntrySegment::Kind::kStrided);
  EXPECT_EQ(s[0].stride, 4096u);
  EXPECT_EQ(s[0].runs, (IndexRuns{{1536, 512}}));
  EXPECT_EQ(s[0].count, 128256u * 512);
  // Shard(0) is FSDP2's one contiguous segment.
  s = segments({10, 4}, {{P::Shard(0)}, -1, {4}}, 1);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].kind, EntrySegment::Kind::kSource);
  EXPECT_EQ(s[0].source_element, 12u);
  // [E, H, I] experts: EP Shard(0), TP Shard(2): the whole middle dim folds, one segment.
  s = segments({8, 16, 32}, {{P::Shard(0), P::Shard(2)}, -1, {2, 4}}, 5);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].stride, 32u);
  EXPECT_EQ(s[0].source_element, 4u * 16 * 32);
  // _StridedShard(0, 2) alone: two contiguous runs of rows.
  s = segments({8, 8}, {{P::StridedShard(0, 2)}, -1, {2}}, 0);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].source_element, 32u);
  // Empty shard: no segment at all.
  EXPECT_TRUE(segments({1, 8}, {{P::Shard(0)}, -1, {2}}, 1).empty());
}

TEST(DTensorByteMap, FillOfAPieceReadsABoundedMultipleOfIt) {
  using P = Placement;
  // [2048, 1024] F32 (8 MiB) Shard(1): runs of 1024/k elements every 1024.
  for (uint32_t k : {2u, 8u, 64u}) {
    Source src({2048, 1024});
    DTensorSharding s{{P::Shard(1)}, -1, {k}};
    const TensorEntry e = Entry({2048, 1024}, s, k - 1);
    const EntryMap m = MapEntry(e, LayoutKind::kDTensor, k, k - 1, "f");
    const uint64_t begin = e.nbytes / 3 / 4 * 4;
    const uint64_t piece = std::min<uint64_t>(256 << 10, e.nbytes - begin);
    std::vector<char> out(piece), scratch;
    const uint64_t read = FillEntry(m, src.Lookup(), src.Read(), begin, piece, out.data(), scratch);
    EXPECT_EQ(read, src.read_bytes);
    const uint64_t run = 1024 / k * 4;
    EXPECT_LE(read, 4 * piece + 2 * run) << "k " << k;
    EXPECT_LE(src.largest, 8u << 20);
    if (k == 2) EXPECT_LT(src.reads, 4u);  // dense runs: a few large reads
    std::vector<float> want = Expected({2048, 1024}, s, k - 1);
    EXPECT_EQ(std::memcmp(out.data(), reinterpret_cast<const char*>(want.data()) + begin, piece), 0);
  }
}

TEST(DTensorByteMap, InverseTilesEveryTensorOnceOverReplicatedDims) {
  using P = Placement;
  const std::vector<uint32_t> mesh = {2, 3};
  std::vector<RankFileHeader> headers(6);
  std::vector<std::string> paths;
  for (uint32_t r = 0; r < 6; ++r) {
    RankFileHeader& h = headers[r];
    LayoutSpec l;
    l.kind = LayoutKind::kDTensor;
    l.mesh.names = {"dp_shard", "tp"};
    l.mesh.shape = mesh;
    l.plan_name = "t";
    l.Normalize();
    h.SetLayout(l);
    h.rank = r;
    h.tensors.push_back(Entry({7, 5}, {{P::StridedShard(0, 3), P::Shard(0)}, 0, mesh}, r));
    h.tensors.back().name = "w";
    h.tensors.push_back(Entry({4, 6}, {{P::Replicate(), P::StridedShard(1, 2)}, -1, mesh}, r));
    h.tensors.back().name = "v";
    h.tensors.push_back(Entry({3}, {{P::Replicate(), P::Replicate()}, -1, mesh}, r));
    h.tensors.back().name = "b";
    paths.push_back("rank" + std::to_string(r));
  }
  // The maps name their source by the entry's name.
  std::vector<const RankFileHeader*> ptrs;
  for (const auto& h : headers) ptrs.push_back(&h);
  const auto locs = DescribeLayoutTensors(ptrs, paths);  // throws unless tiled exactly once
  ASSERT_EQ(locs.size(), 3u);
  EXPECT_EQ(locs[0].nbytes, 7u * 5 * 4);
  EXPECT_EQ(locs[2].pieces.size(), 1u);  // replicated: rank 0's copy only
}

TEST(ParallelPlan, ParsesAppliesAndHashesCanonically) {
  const std::string text = R"J({"format": "reshard.parallel-plan", "format_version": 1, "name": "llama_tp",
    "fsdp": {"mesh_dim": "dp_shard"},
    "rules": [
      {"pattern": "model.layers.*.self_attn.q_proj.weight", "placements": {"tp": "S(0)"}},
      {"pattern": "model.layers.*.self_attn.o_proj.weight", "placements": {"tp": "S(1)"}},
      {"pattern": "model.embed_tokens.weight", "placements": {"tp": "S(1)"}}
    ]})J";
  const ParallelPlan plan = ParseParallelPlan(text, "p.json");
  EXPECT_EQ(plan.name, "llama_tp");
  ASSERT_EQ(plan.rules.size(), 3u);
  const MeshSpec mesh = ParseMeshFlag("dp_shard=2,tp=2");
  auto q = PlanSharding(plan, mesh, "model.layers.12.self_attn.q_proj.weight", 2, false, "p.json");
  EXPECT_EQ(q.placements, (std::vector<Placement>{Placement::StridedShard(0, 2), Placement::Shard(0)}));
  EXPECT_EQ(q.fsdp_mesh_dim, 0);
  auto o = PlanSharding(plan, mesh, "model.layers.0.self_attn.o_proj.weight", 2, false, "p.json");
  EXPECT_EQ(o.placements, (std::vector<Placement>{Placement::Shard(0), Placement::Shard(1)}));
  auto n = PlanSharding(plan, mesh, "model.norm.weight", 1, false, "p.json");
  EXPECT_EQ(n.placements, (std::vector<Placement>{Placement::Shard(0), Placement::Replicate()}));
  auto buf = PlanSharding(plan, mesh, "model.rotary.inv_freq", 1, true, "p.json");
  EXPECT_EQ(buf.placements, (std::vector<Placement>{Placement::Replicate(), Placement::Replicate()}));
  EXPECT_EQ(buf.fsdp_mesh_dim, -1);
  // '*' is one dotted component: not "layers.1.2", not empty.
  EXPECT_FALSE(PlanPatternMatches("a.*.b", "a.1.2.b"));
  EXPECT_FALSE(PlanPatternMatches("a.*.b", "a..b"));
  EXPECT_TRUE(PlanPatternMatches("a.*_proj.b", "a.q_proj.b"));
  // Formatting and key order do not change the hash; a rule does.
  const std::string same = R"J({"rules": [
      {"placements": {"tp": "S(0)"}, "pattern": "model.layers.*.self_attn.q_proj.weight"},
      {"pattern": "model.layers.*.self_attn.o_proj.weight", "placements": {"tp": "S(1)"}},
      {"pattern": "model.embed_tokens.weight", "placements": {"tp": "S(1)"}}],
    "name": "llama_tp", "format_version": 1, "fsdp": {"dim": 0, "mesh_dim": "dp_shard"}, "format": "reshard.parallel-plan"})J";
  EXPECT_EQ(ParseParallelPlan(same, "q.json").xxh3, plan.xxh3);
  std::string other = text;
  other.replace(other.find("\"S(1)\"}}\n    ]"), 6, "\"R\"");
  EXPECT_NE(ParseParallelPlan(other, "r.json").xxh3, plan.xxh3);
  // Golden canonical form: a plan without rules' "fsdp_dim" is written (and hashed) exactly as
  // before that key existed.
  EXPECT_EQ(CanonicalPlanJson(plan),
            R"J({"format":"reshard.parallel-plan","format_version":1,"fsdp":{"dim":0,"mesh_dim":"dp_shard"},)J"
            R"J("name":"llama_tp","rules":[{"pattern":"model.layers.*.self_attn.q_proj.weight",)J"
            R"J("placements":{"tp":"S(0)"}},{"pattern":"model.layers.*.self_attn.o_proj.weight",)J"
            R"J("placements":{"tp":"S(1)"}},{"pattern":"model.embed_tokens.weight","placements":{"tp":"S(1)"}}]})J");
  EXPECT_EQ(plan.xxh3, Xxh3(CanonicalPlanJson(plan)));
  // Layout identity.
  LayoutSpec l;
  l.kind = LayoutKind::kDTensor;
  l.mesh = mesh;
  l.plan_name = plan.name;
  l.plan_xxh3 = plan.xxh3;
  l.dtype = "bf16";
  l.Normalize();
  EXPECT_EQ(l.world_size, 4u);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(plan.xxh3));
  EXPECT_EQ(l.Key(), "dtensor-dp_shard2.tp2-llama_tp." + std::string(hex, 8) + "-bf16");
  EXPECT_EQ(l.ConvertFlags(), "--mesh dp_shard=2,tp=2 --plan llama_tp.json --dtype bf16");
}

// A rule's "fsdp_dim": the tensor dim fully_shard shards for the tensors it matches
// (torchtitan's experts: shard_placement_fn=lambda p: Shard(1)), the plan's fsdp.dim for the rest.
TEST(ParallelPlan, RuleFsdpDimOverridesThePlansForItsTensors) {
  const std::string text = R"J({"format": "reshard.parallel-plan", "format_version": 1, "name": "mixtral_ep",
    "fsdp": {"mesh_dim": "efsdp"},
    "rules": [
      {"pattern": "model.layers.*.mlp.experts.gate_up_proj", "placements": {"ep": "S(0)"}, "fsdp_dim": 1},
      {"pattern": "model.layers.*.mlp.experts.down_proj", "placements": {"ep": "S(1)"}, "fsdp_dim": 1},
      {"pattern": "model.layers.*.mlp.experts.up_proj", "placements": {"ep": "S(0)"}, "fsdp_dim": 0},
      {"pattern": "model.embed_tokens.weight", "placements": {}, "fsdp_dim": 1}
    ]})J";
  const ParallelPlan plan = ParseParallelPlan(text, "p.json");
  ASSERT_EQ(plan.rules.size(), 4u);
  EXPECT_EQ(plan.rules[0].fsdp_dim, std::optional<uint32_t>(1));
  EXPECT_EQ(plan.rules[2].fsdp_dim, std::optional<uint32_t>(0));
  const MeshSpec mesh = ParseMeshFlag("efsdp=2,ep=2");
  const auto R = Placement::Replicate();
  auto gu = PlanSharding(plan, mesh, "model.layers.3.mlp.experts.gate_up_proj", 3, false, "p.json");
  EXPECT_EQ(gu.placements, (std::vector<Placement>{Placement::Shard(1), Placement::Shard(0)}));
  EXPECT_EQ(gu.fsdp_mesh_dim, 0);
  // ep already cuts dim 1: fully_shard's _StridedShard on it, as torch records.
  auto down = PlanSharding(plan, mesh, "model.layers.0.mlp.experts.down_proj", 3, false, "p.json");
  EXPECT_EQ(down.placements, (std::vector<Placement>{Placement::StridedShard(1, 2), Placement::Shard(1)}));
  auto up = PlanSharding(plan, mesh, "model.layers.0.mlp.experts.up_proj", 3, false, "p.json");
  EXPECT_EQ(up.placements, (std::vector<Placement>{Placement::StridedShard(0, 2), Placement::Shard(0)}));
  auto emb = PlanSharding(plan, mesh, "model.embed_tokens.weight", 2, false, "p.json");
  EXPECT_EQ(emb.placements, (std::vector<Placement>{Placement::Shard(1), R}));
  // No rule: the plan's fsdp.dim, 1-D tensors too.
  auto norm = PlanSharding(plan, mesh, "model.norm.weight", 1, false, "p.json");
  EXPECT_EQ(norm.placements, (std::vector<Placement>{Placement::Shard(0), R}));
  EXPECT_EQ(norm.fsdp_mesh_dim, 0);
  // Part of the identity: in the canonical form, and a different dim is a different plan; an
  // explicit "fsdp_dim" equal to the plan's is kept (it is what the file says).
  const std::string canonical = CanonicalPlanJson(plan);
  EXPECT_NE(canonical.find(R"({"fsdp_dim":1,"pattern":"model.layers.*.mlp.experts.gate_up_proj",)"),
            std::string::npos)
      << canonical;
  EXPECT_EQ(ParseParallelPlan(canonical, "c.json").xxh3, plan.xxh3);
  std::string other = text;
  other.replace(other.find("\"fsdp_dim\": 1"), 13, "\"fsdp_dim\": 2");
  EXPECT_NE(ParseParallelPlan(other, "o.json").xxh3, plan.xxh3);
  std::string without = text;
  without.replace(without.find(", \"fsdp_dim\": 1"), 15, "");
  EXPECT_NE(ParseParallelPlan(without, "w.json").xxh3, plan.xxh3);
  // Past the tensor's dims: refused naming the plan, the rule, the tensor, found and expected.
  EXPECT_TRUE(ThrowsError(
      [&] { PlanSharding(plan, mesh, "model.embed_tokens.weight", 1, false, "p.json"); },
      ErrorCode::kInvalidArgument,
      {"p.json", "rules[3]", "model.embed_tokens.weight", "fsdp_dim", "found 1", "expected a dim of its 1"}));
  // The plan's own fsdp.dim past a tensor's dims names the rule key that fixes it.
  const ParallelPlan dim1 = ParseParallelPlan(
      R"J({"format": "reshard.parallel-plan", "format_version": 1, "name": "p", "fsdp": {"mesh_dim": "efsdp", "dim": 1},
          "rules": []})J",
      "d.json");
  EXPECT_TRUE(ThrowsError([&] { PlanSharding(dim1, mesh, "model.norm.weight", 1, false, "d.json"); },
                          ErrorCode::kInvalidArgument, {"d.json", "fsdp.dim 1", "model.norm.weight", "fsdp_dim"}));
}

TEST(ParallelPlan, RefusesWithFileFieldFoundExpected) {
  auto bad = [](const std::string& body, std::initializer_list<std::string_view> needles) {
    const std::string text = R"J({"format": "reshard.parallel-plan", "format_version": 1, )J" + body + "}";
    return ThrowsError([&] { ParseParallelPlan(text, "plan.json"); }, ErrorCode::kDataLoss, needles);
  };
  EXPECT_TRUE(bad(R"J("name": "x y", "rules": [])J", {"plan.json", "name", "x y", "[A-Za-z0-9_]"}));
  EXPECT_TRUE(bad(R"J("name": "p", "rules": [{"pattern": "a", "placements": {"tp": "Shard(0)"}}])J",
                  {"plan.json", "rules[0].placements.tp", "Shard(0)", "S(d)"}));
  EXPECT_TRUE(bad(R"J("name": "p", "rules": [{"pattern": "a b", "placements": {}}])J",
                  {"rules[0].pattern", "a b"}));
  EXPECT_TRUE(bad(R"J("name": "p", "rules": [], "extra": 1)J", {"plan.extra", "unknown key"}));
  EXPECT_TRUE(bad(R"J("name": "p", "fsdp": {"mesh_dim": "dp"}, "rules": [{"pattern": "a", "placements": {"dp": "S(0)"}}])J",
                  {"rules[0].placements.dp", "fully_shard"}));
  EXPECT_TRUE(bad(R"J("name": "p", "rules": {})J", {"rules"}));
  // A rule's fsdp_dim: a non-negative tensor dim, with fsdp only; other keys still unknown.
  EXPECT_TRUE(bad(R"J("name": "p", "fsdp": {"mesh_dim": "dp"}, "rules": [{"pattern": "a", "placements": {}, "fsdp_dim": -1}])J",
                  {"plan.json", "rules[0].fsdp_dim", "-1", "non-negative"}));
  EXPECT_TRUE(bad(R"J("name": "p", "fsdp": {"mesh_dim": "dp"}, "rules": [{"pattern": "a", "placements": {}, "fsdp_dim": "1"}])J",
                  {"rules[0].fsdp_dim", "non-negative"}));
  EXPECT_TRUE(bad(R"J("name": "p", "fsdp": {"mesh_dim": "dp"}, "rules": [{"pattern": "a", "placements": {}, "fsdp_dim": 65}])J",
                  {"rules[0].fsdp_dim", "65", "0 to 64"}));
  EXPECT_TRUE(bad(R"J("name": "p", "rules": [{"pattern": "a", "placements": {}, "fsdp_dim": 1}])J",
                  {"rules[0].fsdp_dim", "no fsdp"}));
  EXPECT_TRUE(bad(R"J("name": "p", "fsdp": {"mesh_dim": "dp"}, "rules": [{"pattern": "a", "placements": {}, "fsdp": 1}])J",
                  {"rules[0].fsdp", "unknown key", "fsdp_dim"}));
  const ParallelPlan p = ParseParallelPlan(
      R"J({"format": "reshard.parallel-plan", "format_version": 1, "name": "p",
          "rules": [{"pattern": "w", "placements": {"ep": "S(0)"}}, {"pattern": "v", "placements": {"tp": "S(2)"}}]})J",
      "plan.json");
  const MeshSpec mesh = ParseMeshFlag("dp=2,tp=2");
  EXPECT_TRUE(ThrowsError([&] { PlanSharding(p, mesh, "w", 2, false, "plan.json"); }, ErrorCode::kInvalidArgument,
                          {"plan.json", "rules[0]", "\"w\"", "\"ep\"", "dp=2,tp=2"}));
  EXPECT_TRUE(ThrowsError([&] { PlanSharding(p, mesh, "v", 2, false, "plan.json"); }, ErrorCode::kInvalidArgument,
                          {"rules[1]", "2 dims", "S(2)"}));
}

}  // namespace
}  // namespace reshard
