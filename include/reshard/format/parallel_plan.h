// Parallel plans (formats/parallel-plan.md): which DTensor placements each parameter gets on a
// named device mesh. Rules map parameter-name patterns to placements per mesh dim (what a
// transformers `base_model_tp_plan` or torchtitan's Llama plan says), and an optional fsdp
// member says which mesh dim fully_shard shards over. Bytes <-> structs; no file opened.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/format/dtensor.h"

namespace reshard {

inline constexpr std::string_view kParallelPlanFormatName = "reshard.parallel-plan";
inline constexpr uint32_t kParallelPlanVersion = 1;

struct PlanRule {
  std::string pattern;  // '*' matches one or more characters other than '.'; the rest literally
  std::vector<std::pair<std::string, Placement>> placements;  // mesh dim name -> placement
  // The tensor dim fully_shard shards for the tensors this rule matches ("fsdp_dim"; a plan
  // with fsdp only); unset: the plan's fsdp_dim. torchtitan's experts with
  // shard_placement_fn=lambda p: Shard(1) while every other parameter keeps Shard(0).
  std::optional<uint32_t> fsdp_dim;
};

struct ParallelPlan {
  std::string name;                 // [A-Za-z0-9_]{1,64}: part of the layout key
  std::optional<std::string> fsdp_mesh_dim;  // fully_shard's mesh dim name
  uint32_t fsdp_dim = 0;            // the tensor dim fully_shard shards (Shard(0) by default;
                                    // a rule's fsdp_dim overrides it for the tensors it matches)
  std::vector<PlanRule> rules;      // first match wins
  uint64_t xxh3 = 0;                // XXH3-64 of the canonical form (CanonicalPlanJson)
};

/// Parses and checks a plan file's text. Throws kDataLoss "<path>: <field>: found ..., expected
/// ..." for anything malformed (unknown keys included).
ParallelPlan ParseParallelPlan(std::string_view text, const std::string& path);

/// The plan as compact JSON with sorted keys: what its xxh3 hashes (formatting and key order of
/// the file do not change a layout's identity; rule order does).
std::string CanonicalPlanJson(const ParallelPlan& plan);

/// Whether `name` matches `pattern` (PlanRule::pattern).
bool PlanPatternMatches(std::string_view pattern, std::string_view name);

/// The sharding of tensor `name` (`ndim` dims) on `mesh` by `plan`: the first matching rule's
/// placements (Replicate on mesh dims it does not name; no rule: Replicate everywhere), and on
/// the fsdp mesh dim what fully_shard
/// records: Shard(d), or _StridedShard(d, k) when the other placements already cut that dim
/// into k pieces (fsdp_mesh_dim set); d the matching rule's fsdp_dim, else the plan's. 0-dim tensors and `whole` ones (the
/// model's buffers: neither TP nor FSDP2 shards them) are Replicate everywhere. Throws kInvalidArgument naming the plan's
/// `path`, the rule and the tensor when a rule names a mesh dim the mesh lacks (or the fsdp
/// one), or a tensor dim the tensor lacks (its placements', its fsdp_dim, the plan's fsdp.dim).
DTensorSharding PlanSharding(const ParallelPlan& plan, const MeshSpec& mesh, std::string_view name,
                             size_t ndim, bool whole, const std::string& path);

/// One tensor of a live job as a plan must place it (PlanOfShardings).
struct PlacedTensor {
  std::string name;
  size_t ndim = 0;
  bool whole = false;          // a persistent buffer (PlanSharding's `whole`)
  DTensorSharding sharding;    // placements and fsdp_mesh_dim as the job's DTensor reports them
};

/// The plan named `name` that gives each of `tensors` exactly its sharding on `mesh` (by
/// PlanSharding): one rule per tensor with a placement other than R on a mesh dim other than
/// fully_shard's or fully_shard on a tensor dim other than 0, its pattern the tensor's exact
/// name, in the given order; the `fsdp` member from the tensors fully_shard sharded, its dim 0
/// (FSDP2's default; a tensor fully_shard shards on dim d > 0, e.g. torchtitan's experts on
/// Shard(1), gets "fsdp_dim": d in its rule, so the plan still places every other tensor of a
/// checkpoint, 1-D ones included). What reshard.save records as the plan of a job's
/// layout (its placements need not come from a plan file). Throws kUnsupported naming the
/// tensor when no plan of this format can say it: fully_shard over two mesh dims, a tensor of ≥ 1 dims that fully_shard left alone while it sharded others, a
/// name with '*' or a space, a sharding that PlanSharding does not give back.
ParallelPlan PlanOfShardings(const std::string& name, const MeshSpec& mesh,
                             const std::vector<PlacedTensor>& tensors);

}  // namespace reshard
