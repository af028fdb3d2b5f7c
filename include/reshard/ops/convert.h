// Conversion of a Hugging Face checkpoint into per-rank files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/format/layout.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {

struct ConvertOptions {
  std::filesystem::path source;
  std::filesystem::path out;
  LayoutSpec layout;
  /// FSDP1 layouts: the model manifest (formats/model-manifest.md). When unset, SOURCE/ and
  /// then OUT/reshard-model.json are used. layout.wrap empty: the manifest's no_split_modules.
  std::optional<std::filesystem::path> model_manifest;
  /// DTensor layouts (layout.kind kDTensor, layout.mesh set): the parallel plan file
  /// (formats/parallel-plan.md); its name and xxh3 complete the layout.
  std::optional<std::filesystem::path> plan_file;
  std::optional<std::pair<uint32_t, uint32_t>> ranks;  // inclusive range; all when unset
  unsigned threads = 0;                                 // 0: hardware concurrency
  Codec codec = Codec::kRaw;
  int zstd_level = 3;
  uint64_t chunk_size = kDefaultChunkSize;
  /// How long to wait for another conversion into the same OUT to release the manifest lock
  /// (held only while the manifest is read at the start and rewritten at the end, so that
  /// conversions of disjoint --ranks can run at the same time, e.g. one per machine).
  double lock_wait_seconds = 60;
  /// Convert into an OUT that is neither empty nor a reshard output of this source (files
  /// there that a conversion writes, config.json among them, are then replaced).
  bool force = false;
  /// Called now and then with (bytes done, bytes total) from the converting thread.
  std::function<void(uint64_t, uint64_t)> progress;
};

/// Refuses (kInvalidArgument, naming the OUT to pass) an output directory that is a layout
/// directory of another output (rank files, reshard.json one level up), --force or not: a
/// conversion into it would nest a second output inside the first. Convert calls it first; the
/// CLI too, before it captures a model manifest into OUT.
void CheckConvertOutput(const std::filesystem::path& out);
/// Refuses (kInvalidArgument) a source that is a reshard output or save (reshard.json in it),
/// naming relayout and export, which read those. Convert and the CLI (before a capture) call it.
void CheckConvertSource(const std::filesystem::path& source);

struct ConvertResult {
  std::string layout_key;
  std::filesystem::path layout_dir;
  std::vector<uint32_t> ranks_written;
  std::vector<uint32_t> ranks_up_to_date;  // already complete, left alone
  /// Ranks whose file was there with the right header but damaged bytes (a chunk that does not
  /// match its checksum, nonzero padding): rewritten (also in ranks_written), with what was found.
  std::vector<std::pair<uint32_t, std::string>> ranks_damaged;
  uint64_t bytes_read = 0;        // source tensor bytes read
  uint64_t bytes_decoded = 0;     // tensor bytes in the written files
  uint64_t bytes_stored = 0;      // bytes written to rank files (after compression)
  double seconds = 0;
  bool layout_complete = false;   // every rank of the layout present afterwards
  uint32_t world_size = 0;
  std::vector<std::string> unused_tensors;  // FSDP1: source tensors the model does not use
  std::vector<std::string> wrap;            // FSDP1: the wrap classes used
};

/// The model manifest convert uses when ConvertOptions::model_manifest is unset:
/// SOURCE/reshard-model.json (beside SOURCE when it is a file), else OUT/reshard-model.json;
/// empty when neither exists.
std::filesystem::path FindModelManifest(const std::filesystem::path& source,
                                        const std::filesystem::path& out);

/// Converts `options.source` into `options.out/<layout key>/rank-*.reshard` and updates the
/// manifest. Rank files already present and valid for the same source and layout are left
/// alone. OUT's lock is held while the manifest is read and while it is rebuilt; rank files
/// are written to temporaries named by host and pid and renamed into place. Throws
/// reshard::Error.
ConvertResult Convert(const ConvertOptions& options);

}  // namespace reshard
