// FSDP1 (FullyShardedDataParallel) FlatParameter layouts: the model manifest captured from a
// meta-device model (formats/model-manifest.md), the replay of auto-wrapping and flattening
// (../shared/docs/fsdp-layouts.md R14–R22), and the filler of a rank's flat shard bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/file_io.h"
#include "reshard/layout.h"

namespace reshard {

inline constexpr std::string_view kModelManifestFormatName = "reshard.model";
inline constexpr uint32_t kModelManifestVersion = 1;
inline constexpr std::string_view kModelManifestName = "reshard-model.json";

struct ModelModule {
  std::string name;   // FQN; "" for the root
  std::string cls;    // class name
  std::vector<std::pair<std::string, uint32_t>> params;  // (local name, index into params),
                                                          // registration order, duplicates kept
};

struct ModelParam {
  std::vector<std::string> names;  // every FQN of this parameter (tied weights: several)
  std::vector<uint64_t> shape;
};

struct ModelBuffer {
  std::string name;
  std::vector<uint64_t> shape;
  bool persistent = true;
};

/// What `python -m reshard.manifest` records about a model: its modules in
/// named_modules(remove_duplicate=False) pre-order, its distinct parameters, its buffers.
struct ModelManifest {
  std::string model_class;
  std::string base_model_prefix;
  std::vector<std::string> no_split_modules;  // the default wrap classes (as accelerate)
  std::vector<ModelModule> modules;           // modules[0] is the root
  std::vector<ModelParam> params;
  std::vector<ModelBuffer> buffers;
};

/// Parses and checks a model manifest; throws kDataLoss naming `path` and the field.
ModelManifest ParseModelManifest(std::string_view json, const std::string& path);
ModelManifest ReadModelManifest(const std::filesystem::path& path);

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

/// Fills bytes [begin, begin + length) of rank `rank`'s shard of `flat` stored as `dtype`
/// (`begin`, `length` multiples of the element size): each parameter's source elements
/// (converted as Tensor.to() when its source dtype differs), 42 for padding, 0 past
/// flat.numel. `sources[i]` is the source tensor of flat.params[i], `files` the open source
/// files in Checkpoint::files order.
void FillFlatShard(const FlatInfo& flat, DType dtype, uint32_t world_size, uint32_t rank,
                   const std::vector<const SourceTensor*>& sources,
                   const std::vector<File>& files, uint64_t begin, uint64_t length, char* out,
                   std::vector<char>& scratch);

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
