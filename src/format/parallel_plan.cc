#include "reshard/format/parallel_plan.h"

#include <nlohmann/json.hpp>

#include "format/json_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/error.h"

namespace reshard {

using internal::Describe;
using internal::GetArray;
using internal::GetString;
using internal::GetU64;
using internal::Member;
using nlohmann::json;

namespace {

void OnlyKeys(const json& obj, std::initializer_list<std::string_view> keys, const std::string& path,
              const std::string& field) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool known = false;
    for (std::string_view k : keys) known |= it.key() == k;
    if (!known) {
      std::string list;
      for (std::string_view k : keys) list += (list.empty() ? "" : ", ") + std::string(k);
      FailField(path, field + "." + Printable(it.key()), "an unknown key", "one of " + list);
    }
  }
}

bool ValidPattern(std::string_view p) {
  if (p.empty() || p.size() > 1024) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    const unsigned char c = p[i];
    if (c < 0x21 || c == 0x7f) return false;                  // no spaces or control characters
    if (c == '*' && i + 1 < p.size() && p[i + 1] == '*') return false;  // "**" means nothing more
  }
  return true;
}

}  // namespace

bool PlanPatternMatches(std::string_view p, std::string_view n) {
  // Backtracking over '*' (each '*' matches 1+ characters other than '.'); patterns are short.
  if (p.empty()) return n.empty();
  if (p[0] != '*') return !n.empty() && n[0] == p[0] && PlanPatternMatches(p.substr(1), n.substr(1));
  for (size_t k = 1; k <= n.size() && n[k - 1] != '.'; ++k) {
    if (PlanPatternMatches(p.substr(1), n.substr(k))) return true;
  }
  return false;
}

ParallelPlan ParseParallelPlan(std::string_view text, const std::string& path) {
  json j = internal::ParseStrictJson(text, path, "parallel plan");
  if (!j.is_object()) FailField(path, "plan", Describe(j), "a JSON object");
  OnlyKeys(j, {"format", "format_version", "name", "fsdp", "rules"}, path, "plan");
  const std::string format = GetString(Member(j, "format", path, "plan"), path, "format");
  if (format != kParallelPlanFormatName) {
    FailField(path, "format", "\"" + Printable(format) + "\"", "\"reshard.parallel-plan\"");
  }
  const uint64_t version = GetU64(Member(j, "format_version", path, "plan"), path, "format_version");
  if (version != kParallelPlanVersion) FailField(path, "format_version", std::to_string(version), "1");
  ParallelPlan plan;
  plan.name = GetString(Member(j, "name", path, "plan"), path, "name");
  if (plan.name.empty() || plan.name.size() > 64 ||
      plan.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") !=
          std::string::npos) {
    FailField(path, "name", "\"" + Printable(plan.name) + "\"", "1 to 64 of [A-Za-z0-9_]");
  }
  if (j.contains("fsdp") && !j["fsdp"].is_null()) {
    const json& f = internal::GetObject(j["fsdp"], path, "fsdp");
    OnlyKeys(f, {"mesh_dim", "dim"}, path, "fsdp");
    plan.fsdp_mesh_dim = GetString(Member(f, "mesh_dim", path, "fsdp"), path, "fsdp.mesh_dim");
    if (f.contains("dim")) {
      const uint64_t d = GetU64(f["dim"], path, "fsdp.dim");
      if (d > 64) FailField(path, "fsdp.dim", std::to_string(d), "a tensor dim (0 to 64)");
      plan.fsdp_dim = static_cast<uint32_t>(d);
    }
  }
  const json& rules = GetArray(Member(j, "rules", path, "plan"), path, "rules");
  for (size_t i = 0; i < rules.size(); ++i) {
    const std::string f = "rules[" + std::to_string(i) + "]";
    const json& r = internal::GetObject(rules[i], path, f);
    OnlyKeys(r, {"pattern", "placements", "fsdp_dim"}, path, f);
    PlanRule rule;
    rule.pattern = GetString(Member(r, "pattern", path, f), path, f + ".pattern");
    if (r.contains("fsdp_dim")) {
      // The tensor dim fully_shard shards for this rule's tensors: only with fsdp.
      const uint64_t d = GetU64(r["fsdp_dim"], path, f + ".fsdp_dim");
      if (d > 64) FailField(path, f + ".fsdp_dim", std::to_string(d), "a tensor dim (0 to 64)");
      if (!plan.fsdp_mesh_dim) {
        FailField(path, f + ".fsdp_dim", std::to_string(d),
                  "none: the plan has no fsdp (fully_shard's mesh dim), so nothing shards that dim");
      }
      rule.fsdp_dim = static_cast<uint32_t>(d);
    }
    if (!ValidPattern(rule.pattern)) {
      FailField(path, f + ".pattern", "\"" + Printable(rule.pattern) + "\"",
                "a parameter name with '*' for one dotted component's characters (no spaces, no \"**\")");
    }
    const json& pl = internal::GetObject(Member(r, "placements", path, f), path, f + ".placements");
    for (auto it = pl.begin(); it != pl.end(); ++it) {
      const std::string pf = f + ".placements." + Printable(it.key());
      const std::string t = GetString(it.value(), path, pf);
      const auto p = ParsePlacement(t);
      if (!p) FailField(path, pf, "\"" + Printable(t) + "\"", "\"R\", \"S(d)\" or \"_S(d,k)\"");
      if (plan.fsdp_mesh_dim && it.key() == *plan.fsdp_mesh_dim) {
        FailField(path, pf, "a placement on fsdp's mesh dim", "none: fully_shard places it");
      }
      rule.placements.emplace_back(it.key(), *p);
    }
    plan.rules.push_back(std::move(rule));
  }
  plan.xxh3 = Xxh3(CanonicalPlanJson(plan));
  return plan;
}

std::string CanonicalPlanJson(const ParallelPlan& plan) {
  json j;  // nlohmann::json keeps keys sorted
  j["format"] = kParallelPlanFormatName;
  j["format_version"] = kParallelPlanVersion;
  j["name"] = plan.name;
  if (plan.fsdp_mesh_dim) j["fsdp"] = {{"mesh_dim", *plan.fsdp_mesh_dim}, {"dim", plan.fsdp_dim}};
  json rules = json::array();
  for (const PlanRule& r : plan.rules) {
    json p = json::object();
    for (const auto& [dim, placement] : r.placements) p[dim] = placement.ToString();
    json rule = {{"pattern", r.pattern}, {"placements", std::move(p)}};
    if (r.fsdp_dim) rule["fsdp_dim"] = *r.fsdp_dim;  // absent when unset: older plans hash as before
    rules.push_back(std::move(rule));
  }
  j["rules"] = std::move(rules);
  return j.dump();
}

DTensorSharding PlanSharding(const ParallelPlan& plan, const MeshSpec& mesh, std::string_view name,
                             size_t ndim, bool whole, const std::string& path) {
  DTensorSharding s;
  s.mesh_shape = mesh.shape;
  s.placements.assign(mesh.ndim(), Placement::Replicate());
  const std::string tensor = "tensor \"" + Printable(name) + "\"";
  int fsdp = -1;
  if (plan.fsdp_mesh_dim) {
    fsdp = mesh.Find(*plan.fsdp_mesh_dim);
    if (fsdp < 0) {
      Fail(ErrorCode::kInvalidArgument, path + ": fsdp.mesh_dim \"" + *plan.fsdp_mesh_dim +
                                            "\" is not a dim of the mesh " + mesh.Flag());
    }
  }
  if (ndim == 0 || whole) return s;  // 0-dim tensors and buffers: whole on every rank
  int matched = -1;
  for (size_t i = 0; i < plan.rules.size(); ++i) {
    const PlanRule& r = plan.rules[i];
    if (!PlanPatternMatches(r.pattern, name)) continue;
    matched = static_cast<int>(i);
    for (const auto& [dim, p] : r.placements) {
      const int m = mesh.Find(dim);
      if (m < 0) {
        Fail(ErrorCode::kInvalidArgument, path + ": rules[" + std::to_string(i) + "] (" + r.pattern +
                                              ") places " + tensor + " on mesh dim \"" + dim +
                                              "\", which the mesh " + mesh.Flag() + " lacks");
      }
      if (p.IsShard() && p.dim >= ndim) {
        Fail(ErrorCode::kInvalidArgument, path + ": rules[" + std::to_string(i) + "] (" + r.pattern +
                                              ") gives " + tensor + " of " + std::to_string(ndim) +
                                              " dims the placement " + p.ToString());
      }
      s.placements[m] = p;
    }
    break;
  }
  if (fsdp >= 0) {
    // The matching rule's fsdp_dim, else the plan's (shard_placement_fn per parameter).
    const PlanRule* rule = matched >= 0 ? &plan.rules[matched] : nullptr;
    const uint32_t dim = rule && rule->fsdp_dim ? *rule->fsdp_dim : plan.fsdp_dim;
    if (dim >= ndim) {
      const std::string found = "found " + std::to_string(dim) + ", expected a dim of its " + std::to_string(ndim) +
                                " (0 to " + std::to_string(ndim - 1) + ")";
      if (rule && rule->fsdp_dim) {
        Fail(ErrorCode::kInvalidArgument, path + ": rules[" + std::to_string(matched) + "] (" + rule->pattern +
                                              ") fsdp_dim of " + tensor + ": " + found);
      }
      Fail(ErrorCode::kInvalidArgument, path + ": fsdp.dim " + std::to_string(dim) + " of " + tensor +
                                            ", which has " + std::to_string(ndim) + " dims (" + found +
                                            "; a rule's \"fsdp_dim\" sets another for the tensors it matches)");
    }
    uint64_t k = 1;  // FSDPParam: split_factor = the DTensor spec's num_shards_map[shard dim]
    for (size_t m = 0; m < mesh.ndim(); ++m) {
      if (s.placements[m].IsShard() && s.placements[m].dim == dim) k *= mesh.shape[m];
    }
    s.placements[fsdp] = k > 1 ? Placement::StridedShard(dim, k) : Placement::Shard(dim);
    s.fsdp_mesh_dim = fsdp;
  }
  return s;
}

ParallelPlan PlanOfShardings(const std::string& name, const MeshSpec& mesh,
                             const std::vector<PlacedTensor>& tensors) {
  ParallelPlan plan;
  plan.name = name;
  const std::string what = "the placements of this job (plan \"" + name + "\" on mesh " + mesh.Flag() + ")";
  auto describe = [&](const PlacedTensor& t) {
    std::string s = "[";
    for (size_t m = 0; m < t.sharding.placements.size(); ++m) {
      s += (m ? ", " : "") + t.sharding.placements[m].ToString();
    }
    s += "]";
    if (t.sharding.fsdp_mesh_dim >= 0 && static_cast<size_t>(t.sharding.fsdp_mesh_dim) < mesh.ndim()) {
      s += " (fully_shard over " + mesh.names[t.sharding.fsdp_mesh_dim] + ")";
    }
    return s;
  };
  const PlacedTensor* first_fsdp = nullptr;
  for (const PlacedTensor& t : tensors) {
    if (t.sharding.placements.size() != mesh.ndim()) {
      Fail(ErrorCode::kInvalidArgument, what + ": tensor \"" + Printable(t.name) + "\" has " +
                                            std::to_string(t.sharding.placements.size()) +
                                            " placements, the mesh " + std::to_string(mesh.ndim()) + " dims");
    }
    const int f = t.sharding.fsdp_mesh_dim;
    if (f < 0) continue;
    if (static_cast<size_t>(f) >= mesh.ndim() || !t.sharding.placements[f].IsShard()) {
      Fail(ErrorCode::kInvalidArgument, what + ": tensor \"" + Printable(t.name) + "\": fsdp mesh dim " +
                                            std::to_string(f) + " without a Shard placement");
    }
    if (!first_fsdp) {
      first_fsdp = &t;
      plan.fsdp_mesh_dim = mesh.names[f];
      plan.fsdp_dim = 0;  // FSDP2's default; a tensor sharded on another dim says so in its rule
    } else if (mesh.names[f] != *plan.fsdp_mesh_dim) {
      Fail(ErrorCode::kUnsupported,
           what + ": fully_shard sharded \"" + first_fsdp->name + "\" as " + describe(*first_fsdp) +
               " and \"" + t.name + "\" as " + describe(t) +
               ": a parallel plan (formats/parallel-plan.md) has one fsdp mesh dim, "
               "so no DTensor layout can record this job's placements");
    }
  }
  for (const PlacedTensor& t : tensors) {
    if (t.name.empty() || t.name.find_first_of("* \t\r\n") != std::string::npos) {
      Fail(ErrorCode::kUnsupported, what + ": tensor name \"" + Printable(t.name) +
                                        "\" cannot be a plan pattern (a '*' or a space in it)");
    }
    PlanRule rule;
    rule.pattern = t.name;
    for (size_t m = 0; m < mesh.ndim(); ++m) {
      if (t.sharding.fsdp_mesh_dim == static_cast<int>(m) ||
          (plan.fsdp_mesh_dim && mesh.names[m] == *plan.fsdp_mesh_dim)) {
        continue;
      }
      if (t.sharding.placements[m].IsShard()) rule.placements.emplace_back(mesh.names[m], t.sharding.placements[m]);
    }
    const int f = t.sharding.fsdp_mesh_dim;
    if (f >= 0 && t.sharding.placements[f].dim != plan.fsdp_dim) rule.fsdp_dim = t.sharding.placements[f].dim;
    if (!rule.placements.empty() || rule.fsdp_dim) plan.rules.push_back(std::move(rule));
  }
  plan.xxh3 = Xxh3(CanonicalPlanJson(plan));
  for (const PlacedTensor& t : tensors) {
    DTensorSharding want = t.sharding;
    want.mesh_shape = mesh.shape;
    const DTensorSharding got = PlanSharding(plan, mesh, t.name, t.ndim, t.whole, what);
    if (got.placements != want.placements || got.fsdp_mesh_dim != want.fsdp_mesh_dim) {
      PlacedTensor g{t.name, t.ndim, t.whole, got};
      Fail(ErrorCode::kUnsupported,
           what + ": tensor \"" + Printable(t.name) + "\" is placed " + describe(t) + ", but a plan gives it " +
               describe(g) + (t.whole ? " (a persistent buffer: whole on every rank)" :
                             t.sharding.fsdp_mesh_dim < 0 && plan.fsdp_mesh_dim
                                 ? " (fully_shard sharded other parameters over " + *plan.fsdp_mesh_dim +
                                       ", not this one: fully_shard the module holding it too, e.g. the root, "
                                       "fully_shard(model, mesh=mesh[\"" + *plan.fsdp_mesh_dim + "\"]))"
                                 : "") +
               "; a DTensor layout records a job only when one parallel plan gives every tensor its placements");
    }
  }
  return plan;
}

}  // namespace reshard
