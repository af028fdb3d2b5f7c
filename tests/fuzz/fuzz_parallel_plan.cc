// libFuzzer target: the parallel plan parser (formats/parallel-plan.md) and what a plan gives a
// tensor. ParseParallelPlan must refuse malformed input with a reshard::Error; a plan it
// accepts has a valid name, its canonical form parses to the same plan hash, and PlanSharding
// either refuses a tensor with a reshard::Error or gives one placement per mesh dim whose
// local shapes (DTensorLocalShape) are those of the index runs (DTensorLocalIndices).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "reshard/base/error.h"
#include "reshard/format/dtensor.h"
#include "reshard/format/parallel_plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "fuzz/plan.json";
  try {
    const reshard::ParallelPlan p =
        reshard::ParseParallelPlan(std::string_view(reinterpret_cast<const char*>(data), size), path);
    if (p.name.empty() || p.name.size() > 64) __builtin_trap();
    if (reshard::ParseParallelPlan(reshard::CanonicalPlanJson(p), path).xxh3 != p.xxh3) __builtin_trap();
    static const reshard::MeshSpec mesh = reshard::ParseMeshFlag("dp_shard=3,tp=2,ep=2");
    for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "w", "a.b"}) {
      try {
        const reshard::DTensorSharding s = reshard::PlanSharding(p, mesh, name, 3, false, path);
        if (s.placements.size() != mesh.ndim()) __builtin_trap();
        for (uint64_t r = 0; r < mesh.Size(); ++r) {
          const auto c = mesh.Coordinate(r);
          const auto shape = reshard::DTensorLocalShape({7, 5, 4}, s, mesh.shape, c, path);
          const auto runs = reshard::DTensorLocalIndices({7, 5, 4}, s, mesh.shape, c, path);
          for (size_t d = 0; d < 3; ++d) {
            if (reshard::CountOf(runs[d]) != shape[d]) __builtin_trap();
          }
        }
      } catch (const reshard::Error&) {
      }
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
