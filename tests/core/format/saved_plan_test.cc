// PlanOfShardings (reshard/format/parallel_plan.h): the plan reshard.save records for a
// DTensor job gives every tensor back exactly its live placements, survives its own canonical
// form (ParseParallelPlan of it has the same identity), and refuses jobs no plan can say.
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/format/parallel_plan.h"

namespace reshard {
namespace {

using test::ThrowsError;

DTensorSharding Sh(std::vector<Placement> p, int fsdp) {
  DTensorSharding s;
  s.placements = std::move(p);
  s.fsdp_mesh_dim = fsdp;
  return s;
}

TEST(SavedPlan, GivesEveryTensorItsPlacementsAndRoundTrips) {
  const MeshSpec mesh = ParseMeshFlag("dp_shard=2,tp=2");
  const auto R = Placement::Replicate();
  const std::vector<PlacedTensor> tensors = {
      {"model.embed_tokens.weight", 2, false, Sh({Placement::StridedShard(0, 2), Placement::Shard(0)}, 0)},
      {"model.layers.0.self_attn.o_proj.weight", 2, false, Sh({Placement::Shard(0), Placement::Shard(1)}, 0)},
      {"model.norm.weight", 1, false, Sh({Placement::Shard(0), R}, 0)},
      {"model.rotary_emb.inv_freq", 1, true, Sh({R, R}, -1)},
  };
  const ParallelPlan plan = PlanOfShardings("saved", mesh, tensors);
  ASSERT_TRUE(plan.fsdp_mesh_dim.has_value());
  EXPECT_EQ(*plan.fsdp_mesh_dim, "dp_shard");
  EXPECT_EQ(plan.fsdp_dim, 0u);
  ASSERT_EQ(plan.rules.size(), 2u);  // only the tensors TP places; fsdp's dim is the plan's
  EXPECT_EQ(plan.rules[0].pattern, "model.embed_tokens.weight");
  for (const PlacedTensor& t : tensors) {
    const DTensorSharding s = PlanSharding(plan, mesh, t.name, t.ndim, t.whole, "saved");
    EXPECT_EQ(s.placements, t.sharding.placements) << t.name;
    EXPECT_EQ(s.fsdp_mesh_dim, t.sharding.fsdp_mesh_dim) << t.name;
  }
  // The canonical JSON is a plan file of the same identity (convert --plan makes the layout).
  const ParallelPlan again = ParseParallelPlan(CanonicalPlanJson(plan), "saved.json");
  EXPECT_EQ(again.xxh3, plan.xxh3);
  // Deterministic: the same placements, the same identity; another placement, another.
  EXPECT_EQ(PlanOfShardings("saved", mesh, tensors).xxh3, plan.xxh3);
  auto other = tensors;
  other[1].sharding = Sh({Placement::StridedShard(0, 2), Placement::Shard(0)}, 0);  // o_proj colwise
  EXPECT_NE(PlanOfShardings("saved", mesh, other).xxh3, plan.xxh3);
}

// torchtitan's expert parallel when efsdp x ep > experts: the experts fully_shard'ed on tensor
// dim 1 (shard_placement_fn=lambda p: Shard(1)) over efsdp, Shard(0) over ep; the rest of the
// job on dim 0. The plan keeps fsdp.dim 0 (a checkpoint's 1-D tensors stay placeable) and gives
// the experts "fsdp_dim": 1 in their rules; every tensor gets its placements back.
TEST(SavedPlan, PerTensorFsdpDimGetsARuleFsdpDim) {
  const MeshSpec mesh = ParseMeshFlag("efsdp=2,ep=2");
  const auto R = Placement::Replicate();
  const std::vector<PlacedTensor> tensors = {
      {"model.layers.0.mlp.experts.gate_up_proj", 3, false, Sh({Placement::Shard(1), Placement::Shard(0)}, 0)},
      {"model.layers.0.mlp.experts.down_proj", 3, false, Sh({Placement::Shard(1), Placement::Shard(0)}, 0)},
      {"model.layers.0.mlp.experts.bias", 2, false, Sh({Placement::Shard(1), R}, 0)},  // dim 1, no ep
      {"model.norm.weight", 1, false, Sh({Placement::Shard(0), R}, 0)},
      {"model.rotary_emb.inv_freq", 1, true, Sh({R, R}, -1)},
  };
  const ParallelPlan plan = PlanOfShardings("saved", mesh, tensors);
  ASSERT_TRUE(plan.fsdp_mesh_dim.has_value());
  EXPECT_EQ(plan.fsdp_dim, 0u);
  ASSERT_EQ(plan.rules.size(), 3u);
  for (const PlanRule& r : plan.rules) {
    ASSERT_TRUE(r.fsdp_dim.has_value()) << r.pattern;
    EXPECT_EQ(*r.fsdp_dim, 1u) << r.pattern;
  }
  EXPECT_TRUE(plan.rules[2].placements.empty());  // fsdp_dim alone
  for (const PlacedTensor& t : tensors) {
    const DTensorSharding s = PlanSharding(plan, mesh, t.name, t.ndim, t.whole, "saved");
    EXPECT_EQ(s.placements, t.sharding.placements) << t.name;
    EXPECT_EQ(s.fsdp_mesh_dim, t.sharding.fsdp_mesh_dim) << t.name;
  }
  // A 1-D tensor of the checkpoint the job does not hold here (a dense parameter of an EP job)
  // is still placed: S(0) over efsdp.
  EXPECT_EQ(PlanSharding(plan, mesh, "model.embed_tokens.bias", 1, false, "saved").placements,
            (std::vector<Placement>{Placement::Shard(0), R}));
  const std::string canonical = CanonicalPlanJson(plan);
  EXPECT_NE(canonical.find(R"("fsdp_dim":1,"pattern":"model.layers.0.mlp.experts.gate_up_proj")"),
            std::string::npos)
      << canonical;
  const ParallelPlan again = ParseParallelPlan(canonical, "saved.json");
  EXPECT_EQ(again.xxh3, plan.xxh3);
  // Every tensor on dim 1 alike: still fsdp.dim 0, the dim in each rule.
  const ParallelPlan all1 = PlanOfShardings("saved", mesh, {tensors[0], tensors[1]});
  EXPECT_EQ(all1.fsdp_dim, 0u);
  ASSERT_EQ(all1.rules.size(), 2u);
  EXPECT_EQ(all1.rules[1].fsdp_dim, std::optional<uint32_t>(1));
}

TEST(SavedPlan, RefusesJobsNoPlanCanSayNamingTheTensor) {
  const MeshSpec mesh = ParseMeshFlag("dp_shard=2,tp=2");
  const auto R = Placement::Replicate();
  // fully_shard over dp_shard for one parameter, not for another of ≥ 1 dims.
  EXPECT_TRUE(ThrowsError(
      [&] {
        PlanOfShardings("saved", mesh, {{"a.weight", 2, false, Sh({Placement::Shard(0), R}, 0)},
                                        {"b.weight", 2, false, Sh({R, Placement::Shard(0)}, -1)}});
      },
      ErrorCode::kUnsupported, {"\"b.weight\"", "[R, S(0)]", "not this one"}));
  // fully_shard over two mesh dims.
  EXPECT_TRUE(ThrowsError(
      [&] {
        PlanOfShardings("saved", mesh, {{"a.weight", 2, false, Sh({Placement::Shard(0), R}, 0)},
                                        {"b.weight", 2, false, Sh({R, Placement::Shard(0)}, 1)}});
      },
      ErrorCode::kUnsupported, {"\"a.weight\"", "\"b.weight\"", "one fsdp mesh dim"}));
  // A sharded buffer (convert stores buffers whole).
  EXPECT_TRUE(ThrowsError(
      [&] { PlanOfShardings("saved", mesh, {{"buf", 1, true, Sh({R, Placement::Shard(0)}, -1)}}); },
      ErrorCode::kUnsupported, {"\"buf\"", "persistent buffer"}));
  // A name a pattern cannot hold.
  EXPECT_TRUE(ThrowsError(
      [&] { PlanOfShardings("saved", mesh, {{"a.*", 1, false, Sh({R, Placement::Shard(0)}, -1)}}); },
      ErrorCode::kUnsupported, {"\"a.*\"", "pattern"}));
}

}  // namespace
}  // namespace reshard
