// `reshard relayout` (alias `reshard reshard`): another layout of a checkpoint OUT already
// holds, made from one of its layouts: a training checkpoint saved by reshard.save at world
// size N (weights and, when saved, optimizer state: KEY/optim/) turned into the layout of
// world size M, or into the DTensor layout of another device mesh and parallel plan (a
// tensor-parallel job resumed on another mesh), or a conversion's layout into another. Offline, CPU only, host memory bounded
// by a few chunk buffers per thread; every source chunk is checked against its chunk_xxh3
// before any of its bytes is used; atomic as convert (rank files under temporary names, then
// renamed; optimizer.json and the manifest's entry for the new layout written last, under
// OUT's lock, and only once every rank file of the new layout is there, so that a killed run
// leaves no layout that loads or verifies; a re-run completes it).
//
// The bytes come from the source layout through the one byte map: the source layout described
// as a virtual checkpoint (DescribeLayoutTensors; optimizer state: DescribeOptimizerTensors),
// planned for the target (PlanRank / PlanOptimizerRank), filled by FillEntry, written by the
// rank-file writer convert uses.
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

struct RelayoutOptions {
  std::filesystem::path out;  // the checkpoint directory (reshard.json)
  uint32_t world_size = 0;    // of the new layout
  /// The new layout's kind and FSDP1 fields; each unset one is the source layout's (when the
  /// kind is the source's), else convert's default.
  std::optional<LayoutKind> kind;
  std::optional<std::vector<std::string>> wrap;
  std::optional<bool> use_orig_params;
  std::optional<std::string> param_dtype;
  /// DTensor targets (both or neither): the device mesh (world_size 0 or its size) and the
  /// parallel plan file giving the placements, as `reshard convert --mesh M --plan FILE`.
  /// Without them the kind defaults to fsdp2 when the source is a DTensor layout.
  std::optional<MeshSpec> mesh;
  std::optional<std::filesystem::path> plan_file;
  /// The layout to read (a key of OUT's manifest); unset: the only complete one that is not
  /// the target (with optimizer state, when several are and exactly one has it).
  std::optional<std::string> from;
  /// FSDP1 targets: the model manifest; default OUT/reshard-model.json.
  std::optional<std::filesystem::path> model_manifest;
  std::optional<std::pair<uint32_t, uint32_t>> ranks;  // inclusive; all when unset
  /// Write no rank file; only commit the new layout when all its rank files are there.
  bool commit_only = false;
  unsigned threads = 0;                                 // 0: twice the hardware concurrency
  Codec codec = Codec::kRaw;
  int zstd_level = 3;
  uint64_t chunk_size = kDefaultChunkSize;
  double lock_wait_seconds = 60;
  std::function<void(uint64_t, uint64_t)> progress;  // (bytes done, bytes total)
};

struct RelayoutResult {
  std::string from_key;
  std::string layout_key;
  std::filesystem::path layout_dir;
  uint32_t world_size = 0;
  bool optimizer = false;  // the source has optimizer state, and so does the new layout
  std::vector<uint32_t> ranks_written;
  std::vector<uint32_t> ranks_up_to_date;
  /// Ranks whose file was there with the right header but damaged bytes (a chunk that does not
  /// match its checksum, nonzero padding): rewritten (also in ranks_written), with what was found.
  std::vector<std::pair<uint32_t, std::string>> ranks_damaged;
  uint64_t bytes_read = 0;     // source bytes read (whole chunks)
  uint64_t bytes_decoded = 0;  // tensor bytes written (model and optimizer)
  uint64_t bytes_stored = 0;
  /// Every rank file of the new layout (and of its optim/) is there, and the manifest (and
  /// optimizer.json) now list it; false when other ranks (another process's --ranks) remain.
  bool committed = false;
  std::vector<uint32_t> ranks_missing;  // when not committed
  double seconds = 0;
};

/// Throws reshard::Error: kNotFound (no manifest, no such layout, a missing optimizer file),
/// kMismatch (an incomplete source layout, files of another save), kInvalidArgument (the
/// target is the source, bad ranks, --mesh without --plan), kUnsupported (optimizer state
/// across layout kinds other than fsdp2 <-> dtensor).
RelayoutResult Relayout(const RelayoutOptions& options);

struct RelayoutProblem {
  std::string file, tensor, message;
};

/// Compares layout `key` of OUT, which `reshard relayout` made from layout `from` of the same
/// OUT (the manifest's `from`), with that layout element for element: every rank file (and,
/// when `from` has optimizer state, every optim/ rank file and optimizer.json's layout) holds
/// exactly the entries the relayout plans, and every chunk equals the bytes the byte map
/// fills from `from`'s rank files (both sides' chunks checked against their checksums).
/// Problems are returned, not thrown (files that cannot be read among them); adds the bytes
/// compared to `bytes_compared`.
std::vector<RelayoutProblem> CheckRelayout(const std::filesystem::path& out, const std::string& key,
                                           unsigned threads, uint64_t& bytes_compared);

/// The target ranks of process `index` of `count` processes splitting `world_size` ranks:
/// contiguous blocks, the first world_size % count processes one rank more; nullopt when this
/// process has none (count > world_size).
std::optional<std::pair<uint32_t, uint32_t>> SplitRanks(uint32_t world_size, uint32_t index,
                                                        uint32_t count);

/// This process's index and the process count from a job launcher's environment (`getenv`):
/// SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (a Slurm array; ids from
/// SLURM_ARRAY_TASK_MIN), else RANK / WORLD_SIZE (torchrun: processes of the launch, not the
/// layout's world size), else SLURM_PROCID / SLURM_NTASKS (srun). `what` is set to the
/// variables used. Throws kInvalidArgument when none is set or a value is not a number in
/// range, naming the variable and its value.
std::pair<uint32_t, uint32_t> LauncherProcess(const std::function<const char*(const char*)>& getenv,
                                              std::string& what);

}  // namespace reshard
