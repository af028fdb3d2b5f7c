// FSDP1 (FullyShardedDataParallel) FlatParameter layouts: the replay of auto-wrapping and
// flattening (../shared/docs/fsdp-layouts.md R14–R22) for a model manifest
// (reshard/format/model_manifest.h), and the filler of a rank's flat shard bytes. Pure: the
// source bytes come through the caller's SourceRead.
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

/// Reads exactly `size` bytes at absolute offset `offset` of source file `file_index`
/// (Checkpoint::files order) into `dst`; a short read throws kDataLoss.
using SourceRead = std::function<void(size_t file_index, uint64_t offset, size_t size, void* dst)>;

/// Fills bytes [begin, begin + length) of rank `rank`'s shard of `flat` stored as `dtype`
/// (`begin`, `length` multiples of the element size): each parameter's source elements
/// (converted as Tensor.to() when its source dtype differs), 42 for padding, 0 past
/// flat.numel. `sources[i]` is the source tensor of flat.params[i]; `read` reads the source
/// files' bytes.
void FillFlatShard(const FlatInfo& flat, DType dtype, uint32_t world_size, uint32_t rank,
                   const std::vector<const SourceTensor*>& sources, const SourceRead& read,
                   uint64_t begin, uint64_t length, char* out, std::vector<char>& scratch);

/// (file index, absolute offset) of the first source byte that bytes [begin, ...) of the
/// shard read, for ordering reads; (0, 0) when they hold only padding.
std::pair<size_t, uint64_t> FlatSourcePosition(const FlatInfo& flat, DType dtype,
                                               uint32_t world_size, uint32_t rank,
                                               const std::vector<const SourceTensor*>& sources,
                                               uint64_t begin);

/// The checkpoint key holding `name` (exact, without or with the base model prefix), as
/// transformers maps keys; nullptr when absent.
const SourceTensor* FindSourceTensor(const Checkpoint& ckpt, const std::string& name,
                                     const std::string& base_model_prefix);

}  // namespace reshard
