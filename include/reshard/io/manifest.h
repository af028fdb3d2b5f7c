// The manifests on disk: OUT/reshard.json (formats/manifest.md) read, written and rebuilt
// from the rank files present, and the model manifest (formats/model-manifest.md) read.
// Their bytes are parsed and serialized by reshard/format/manifest.h and model_manifest.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
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

class RankFileReader;

/// Checks that `reader` is the file OUT's manifest lists as rank `rank` of layout `key`: the
/// size and header hash recorded when it was written, and its header's layout key, dtype
/// policy and source are the manifest's. A rank file replaced by another conversion into the
/// same OUT (another source, dtype or layout) fails here. Throws kMismatch naming the file,
/// what it holds and what `manifest_path` says, and the command that fixes it.
void CheckListed(const RankFileReader& reader, const Manifest& manifest, const std::string& key,
                 uint32_t rank, const std::string& manifest_path);

}  // namespace reshard
