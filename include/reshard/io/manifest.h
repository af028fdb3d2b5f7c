// The manifests on disk: OUT/reshard.json (formats/manifest.md) read, written and rebuilt
// from the rank files present, and the model manifest (formats/model-manifest.md) read.
// Their bytes are parsed and serialized by reshard/format/manifest.h and model_manifest.h.
#pragma once

#include <filesystem>
#include <optional>

#include "reshard/format/checkpoint.h"
#include "reshard/format/layout.h"
#include "reshard/format/manifest.h"
#include "reshard/format/model_manifest.h"

namespace reshard {

/// Reads OUT/reshard.json; nullopt when absent. Throws kDataLoss when malformed.
std::optional<Manifest> ReadManifest(const std::filesystem::path& out);
void WriteManifest(const std::filesystem::path& out, const Manifest& manifest);

/// Rebuilds the entry of layout `key` from the rank files present in OUT/key (each one's
/// preamble and header is validated; files of another source or layout are errors).
ManifestLayout ScanLayout(const std::filesystem::path& out, const LayoutSpec& layout,
                          const SourceFingerprint& source);

ModelManifest ReadModelManifest(const std::filesystem::path& path);

}  // namespace reshard
