// A layout's identity, as rank files and manifests record it: its kind, world size and
// dtype policy (the layout key), the chunk rule of FSDP2 rows, and the unsharded layout of an
// FSDP1 flat parameter. Planning a checkpoint into a layout: reshard/plan/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/format/dtensor.h"

namespace reshard {

enum class LayoutKind {
  kFsdp2,  // one DTensor per parameter, Shard(0) (fully_shard)
  kFsdp1,  // one FlatParameter per wrapped unit (FullyShardedDataParallel)
  kDTensor,  // one DTensor per parameter on a named device mesh, placements from a plan
};

struct RowRange {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - start; }
  bool operator==(const RowRange&) const = default;
};

/// The chunk rule (torch.chunk / FSDP2 _chunk_with_empty): c = ceil(n / W), rank r owns
/// [min(r·c, n), min((r+1)·c, n)). Requires world_size ≥ 1 and rank < world_size.
RowRange ChunkRows(uint64_t n, uint64_t world_size, uint64_t rank);

struct LayoutSpec {
  LayoutKind kind = LayoutKind::kFsdp2;
  uint32_t world_size = 1;
  std::string dtype = "keep";  // the dtype policy: keep, bf16, fp16, fp32 (base/dtype_convert.h)
  // FSDP1 only (empty/false for FSDP2):
  std::vector<std::string> wrap;  // wrapped module classes, sorted and unique
  bool use_orig_params = false;   // alignment padding (fsdp-layouts R17)
  std::string param_dtype;        // MixedPrecision.param_dtype ("", bf16, fp16, fp32); only
                                  // meaningful with use_orig_params (it sets the alignment)
  // DTensor only (empty otherwise): the device mesh (world_size = its size) and the parallel
  // plan's identity (formats/parallel-plan.md): its name and the XXH3-64 of its canonical form.
  MeshSpec mesh;
  std::string plan_name;
  uint64_t plan_xxh3 = 0;

  /// Directory name and manifest key, e.g. "fsdp2-ws8", "fsdp2-ws8-bf16",
  /// "fsdp1-ws8-LlamaDecoderLayer-orig-pbf16-fp32" (classes joined by '.', or "w<hash>" when
  /// the list is long), "dtensor-dp_shard2.tp2-llama_tp.1a2b3c4d" (mesh, plan name and the
  /// first 8 hex digits of the plan's xxh3).
  std::string Key() const;
  /// The `reshard convert` options that produce this layout ("--world-size 8 --layout fsdp1
  /// --wrap LlamaDecoderLayer --dtype fp32", "--mesh dp_shard=2,tp=2 --plan llama_tp.json":
  /// a plan file is named after its plan): what an error tells the user to run.
  std::string ConvertFlags() const;
  std::string KindName() const;
  /// Sorts and dedups `wrap`, drops param_dtype without use_orig_params; checks values.
  /// Throws kInvalidArgument.
  void Normalize();
};

std::optional<LayoutKind> ParseLayoutKind(std::string_view name);

/// One original parameter inside an FSDP1 FlatParameter (fsdp-layouts R15–R19).
struct FlatParamInfo {
  std::string fqn;                 // relative to the unit's module, as FlatParameter._fqns
  std::string key;                 // source tensor holding its values
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  uint64_t offset = 0;             // first element in the unsharded flat parameter
  bool operator==(const FlatParamInfo&) const = default;
};

/// The unsharded FlatParameter of one FSDP1 unit: `params` in flat order; every element of
/// [0, numel) not covered by a param is padding holding 42 (_FLAT_PARAM_PADDING_VALUE); a
/// rank's shard is flat [r·c, (r+1)·c), c = ceil(numel / W), zero beyond numel.
struct FlatInfo {
  std::string unit;              // module FQN of the unit ("" for the root)
  uint64_t numel = 0;            // alignment and (use_orig_params) world-size padding included
  uint64_t aligned_numel = 0;    // 0 without use_orig_params
  std::vector<FlatParamInfo> params;
  std::vector<std::string> shared;  // FQNs (relative) of aliases of params in this unit
  bool operator==(const FlatInfo&) const = default;
};

/// Name of a unit's entry in rank files: "<unit>._flat_param", "_flat_param" for the root.
std::string FlatEntryName(const std::string& unit);

}  // namespace reshard
