// The model manifest captured from a meta-device model (formats/model-manifest.md): what the
// FSDP1 layouts are planned from (reshard/plan/fsdp1.h). Parsed from bytes here; read from a
// file by ReadModelManifest (reshard/io/manifest.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace reshard {

inline constexpr std::string_view kModelManifestFormatName = "reshard.model";
inline constexpr uint32_t kModelManifestVersion = 2;  // 1 is read too (no conversion)
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
  // A parameter the model never saves (transformers' _keys_to_ignore_on_save: Marian's
  // sinusoidal positions) and from_pretrained computes: it may be absent from the checkpoint.
  bool unsaved = false;
};

struct ModelBuffer {
  std::string name;
  std::vector<uint64_t> shape;
  bool persistent = true;
};

/// How one tensor of the model is assembled from checkpoint tensors: a tree of pure
/// rearrangements (formats/model-manifest.md, "conversion"). `shape` is every node's shape,
/// given for keys and computed (and checked) for the others.
struct ConversionExpr {
  enum class Op : uint8_t { kKey, kStack, kCat, kSlice, kDequantFp8, kDequantMxfp4 };
  Op op = Op::kKey;
  std::string key;                  // kKey: the checkpoint tensor
  std::string dtype;                // kKey: its dtype as recorded at capture ("BF16", ...);
                                    // kDequantFp8, kDequantMxfp4: the result's dtype ("BF16")
  uint32_t dim = 0;                 // kStack, kCat, kSlice
  uint64_t start = 0, stop = 0;     // kSlice: [start, stop) of dim
  uint64_t block_rows = 0, block_cols = 0;  // kDequantFp8: elements of the weight per scale
  std::vector<ConversionExpr> of;   // kStack, kCat: ≥ 1 children; kSlice: exactly 1;
                                    // kDequantFp8: [weight key (F8_E4M3), scale key (F32)];
                                    // kDequantMxfp4: [blocks key (U8 [E, N, G, 16]),
                                    // scales key (U8 [E, N, G])], shape [E, G·32, N]
  std::vector<uint64_t> shape;
};

/// How the capture treats a quantized checkpoint (formats/model-manifest.md, "quantization").
struct Quantization {
  enum class Policy : uint8_t { kDequantize, kKeep };
  std::string method;  // "fp8", "mxfp4"
  Policy policy = Policy::kDequantize;
  std::vector<uint64_t> weight_block_size;  // config.json's, e.g. [128, 128]
};

/// A model tensor whose checkpoint key or layout differs: transformers' renames and fusions
/// (conversion_mapping.py, WeightConverter) resolved against the checkpoint's keys.
struct ConversionTarget {
  std::string name;
  ConversionExpr expr;
};

struct Conversion {
  std::string transformers_version;
  std::vector<ConversionTarget> targets;  // sorted by name, unique
  std::vector<std::string> refused;       // "why" lines: tensors the capture could not express
  std::optional<Quantization> quantization;  // a quantized checkpoint: its policy
  /// The target called `name`; nullptr when the tensor is not converted.
  const ConversionTarget* Find(std::string_view name) const;
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
  /// Version 2: the checkpoint's conversion to the model's names and shapes (targets may be
  /// empty: names already match); absent in version 1 or when captured without a checkpoint.
  std::optional<Conversion> conversion;
};

/// Parses and checks a model manifest; throws kDataLoss naming `path` and the field.
ModelManifest ParseModelManifest(std::string_view json, const std::string& path);

}  // namespace reshard
