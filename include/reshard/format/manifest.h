// The output directory's manifest (formats/manifest.md). Read, written and rebuilt from the
// rank files in OUT by reshard/io/manifest.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/format/layout.h"
#include "reshard/format/source.h"

namespace reshard {

inline constexpr std::string_view kManifestName = "reshard.json";
// A save of a PEFT model's adapters (reshard.save) lists PEFT's adapter config among its aux
// files; `reshard export --adapter` writes the adapters as PEFT does (formats/manifest.md).
inline constexpr std::string_view kAdapterConfigName = "adapter_config.json";
inline constexpr std::string_view kAdapterWeightsName = "adapter_model.safetensors";
// reshard.save of a PEFT model also lists this record: which tensors of the layout are the
// adapter's, whether the save holds the base too (`base=True`) and where the base came from.
inline constexpr std::string_view kAdapterRecordName = "reshard-adapter.json";
inline constexpr std::string_view kManifestFormatName = "reshard.manifest";
inline constexpr uint32_t kManifestVersion = 1;
inline constexpr std::string_view kLockName = ".reshard.lock";
// Held (shared) by every conversion into OUT while it runs, naming its source: a conversion
// of another source is refused at once (formats/manifest.md, "Concurrent conversions").
inline constexpr std::string_view kConvertClaimName = ".reshard.convert";

struct ManifestRank {
  uint32_t rank = 0;
  std::string file;
  uint64_t size = 0;
  uint64_t header_xxh3 = 0;
};

struct ManifestLayout {
  std::string key;
  LayoutKind kind = LayoutKind::kFsdp2;
  uint32_t world_size = 1;
  std::string dtype = "keep";
  std::vector<std::string> wrap;  // FSDP1 (LayoutSpec)
  bool use_orig_params = false;
  std::string param_dtype;
  MeshSpec mesh;  // DTensor (LayoutSpec): mesh, plan_name, plan_xxh3
  std::string plan_name;
  uint64_t plan_xxh3 = 0;
  std::string dir;
  std::vector<ManifestRank> ranks;
  bool complete = false;
  /// The layout of the same OUT this one was made from by `reshard relayout` ("" otherwise):
  /// `reshard verify OUT` compares the two element for element.
  std::string from;
  /// A save of an expert-parallel job writes the model as several layouts, each holding part
  /// of its tensors: their keys (this one among them, sorted), listed alike in each. Empty: this
  /// layout holds the whole model. Readers that need the whole model skip such a layout.
  std::vector<std::string> parts;

  LayoutSpec Layout() const;
};

struct Manifest {
  std::string writer;
  SourceFingerprint source;
  std::vector<std::string> aux_files;
  std::map<std::string, ManifestLayout> layouts;
};

std::string SerializeManifest(const Manifest& manifest);
Manifest ParseManifest(std::string_view json, const std::string& path);

}  // namespace reshard
