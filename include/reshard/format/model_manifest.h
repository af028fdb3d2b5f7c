// The model manifest captured from a meta-device model (formats/model-manifest.md): what the
// FSDP1 layouts are planned from (reshard/plan/fsdp1.h). Parsed from bytes here; read from a
// file by ReadModelManifest (reshard/io/manifest.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

}  // namespace reshard
