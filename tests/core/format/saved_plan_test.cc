// PlanOfShardings (reshard/format/parallel_plan.h): the plan reshard.save records for a
// DTensor job gives every tensor back exactly its live placements, survives its own canonical
// form (ParseParallelPlan of it has the same identity), and refuses jobs no plan can say.
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
  // fully_shard on two tensor dims.
  EXPECT_TRUE(ThrowsError(
      [&] {
        PlanOfShardings("saved", mesh, {{"a.weight", 2, false, Sh({Placement::Shard(0), R}, 0)},
                                        {"b.weight", 2, false, Sh({Placement::Shard(1), R}, 0)}});
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
