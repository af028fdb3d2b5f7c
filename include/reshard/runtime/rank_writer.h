// Writing rank files from tensors in memory (host or device), behind reshard.save, and the
// manifest of a checkpoint saved from training. The file itself is written by the one
// rank-file writer, RankFileWriter (reshard/io/rank_file_writer.h), which `reshard convert`
// uses too.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/format/manifest.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/rank_file_writer.h"
#include "reshard/runtime/device_copier.h"

namespace reshard {

/// One tensor to save: `nbytes` contiguous bytes at `ptr`, in host memory or (on_device) in
/// the memory of the copier's device.
struct SaveSource {
  std::string name;
  const void* ptr = nullptr;
  uint64_t nbytes = 0;
  bool on_device = false;
};

struct SaveOptions {
  /// Device tensors go through this many bytes of pinned staging (two halves: one is copied
  /// from the device while the other is written). Rounded up to a multiple of 8192.
  uint64_t staging_bytes = 32ull << 20;
  bool verify_data = false;  // RankFileWriter::Commit(verify_data)
  /// Called before each tensor's bytes are written (index into the sources); a test hook
  /// to interrupt a save at a known point.
  std::function<void(size_t)> before_tensor;
};

struct SaveReport {
  uint64_t bytes = 0;          // tensor bytes written
  uint64_t file_size = 0;
  uint64_t header_xxh3 = 0;
  uint64_t staging_bytes = 0;  // pinned staging used (device sources only)
  double seconds = 0;
};

/// Writes the rank file `path` for `header` (entries as in RankFileWriter::Create) from
/// `sources`, one per entry (matched by name, each exactly once, nbytes equal to the
/// entry's). Host sources are written straight from their memory; device sources need
/// `copier` and are copied device → pinned staging → file in bounded pieces, double
/// buffered. No copy of a whole tensor is ever made. Atomic as RankFileWriter::Commit.
SaveReport SaveRankFile(const std::filesystem::path& path, RankFileHeader header,
                        std::span<const SaveSource> sources, DeviceCopier* copier,
                        const SaveOptions& options);

/// After every rank file of a saved layout exists: under OUT's lock, checks each file of
/// OUT/<layout key> (ScanLayout: header valid, same layout, source `source`), requires all
/// `layout.world_size` of them (kDataLoss naming the missing ranks otherwise), and writes
/// OUT/reshard.json with `source`, `aux_files` and the layout entry, atomically. A manifest
/// already in OUT must have the same source (kMismatch otherwise). `parts`: the keys of the
/// layouts this save writes the model as, when more than one (ManifestLayout::parts). Returns
/// the entry.
ManifestLayout WriteSavedManifest(const std::filesystem::path& out, const LayoutSpec& layout,
                                  const SourceFingerprint& source,
                                  const std::vector<std::string>& aux_files,
                                  const std::vector<std::string>& parts = {});

}  // namespace reshard
