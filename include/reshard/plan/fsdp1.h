// FSDP1 (FullyShardedDataParallel) FlatParameter layouts: the replay of auto-wrapping and
// flattening (../shared/docs/fsdp-layouts.md R14–R22) for a model manifest
// (reshard/format/model_manifest.h). Which bytes a rank's flat shard holds is the byte map's
// (reshard/plan/byte_map.h). Pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/layout.h"
#include "reshard/format/model_manifest.h"

namespace reshard {

/// The units of one FSDP1 layout, the same for every rank.
struct Fsdp1Plan {
  std::vector<std::shared_ptr<const FlatInfo>> units;  // construction order (post-order)
  std::vector<size_t> buffers;      // Checkpoint::tensors indices of persistent buffers
  std::vector<std::string> unused;  // source tensors that are no parameter or buffer
};

/// Replays FSDP1 auto-wrapping (every module whose class is in layout.wrap, and the root) and
/// flattening (order, alignment padding, world-size padding) for `model` with the values of
/// `ckpt`, under the layout's dtype policy. Throws kInvalidArgument (unknown wrap class,
/// mixed dtypes in a unit) or kMismatch (a parameter missing from the checkpoint or shaped
/// differently).
Fsdp1Plan PlanFsdp1(const Checkpoint& ckpt, const ModelManifest& model, const LayoutSpec& layout);

/// Bit pattern of FSDP1's padding value 42 in `dtype` (F16, BF16, F32, F64).
uint64_t FlatPaddingBits(DType dtype);

/// The checkpoint key holding `name` (exact, without or with the base model prefix), as
/// transformers maps keys; nullptr when absent.
const SourceTensor* FindSourceTensor(const Checkpoint& ckpt, const std::string& name,
                                     const std::string& base_model_prefix);

}  // namespace reshard
