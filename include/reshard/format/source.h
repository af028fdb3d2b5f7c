// The identity of a source checkpoint as rank files and manifests record it
// (formats/rank-file.md, `source`).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace reshard {

struct SourceFile {
  std::string name;  // file name relative to the checkpoint directory
  uint64_t size = 0;
  uint64_t header_xxh3 = 0;
  uint64_t sample_xxh3 = 0;  // first and last 4 KiB of each tensor (formats/rank-file.md)
};

/// The source record of a checkpoint written from a live model by reshard.save
/// (formats/rank-file.md, `source.saved`): there are no source files; `id` is chosen at
/// random by the saving job (one per save), `step` is the training step when given.
struct SavedSource {
  uint64_t id = 0;
  std::optional<uint64_t> step;
  bool operator==(const SavedSource&) const = default;
};

/// Identity of a source checkpoint (formats/rank-file.md, `source`).
struct SourceFingerprint {
  std::vector<SourceFile> files;  // sorted by name
  std::optional<SavedSource> saved;  // set only for checkpoints saved from training (no files)
  uint64_t fingerprint = 0;

  static SourceFingerprint FromFiles(std::vector<SourceFile> files);
  /// The source of a checkpoint saved from training: no files, fingerprint over `saved`.
  static SourceFingerprint FromSaved(const SavedSource& saved);
  bool operator==(const SourceFingerprint& other) const;
};

}  // namespace reshard
