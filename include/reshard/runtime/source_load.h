// Loading a rank's part of a layout from where the bytes already are, when no rank file of
// that layout exists: a Hugging Face checkpoint (safetensors or torch zip, with transformers'
// conversion when a model manifest is given), or the rank files of another layout of the same
// model (another world size or kind, a save from training). Nothing is written.
//
// A SourceRankView plans the rank exactly as `reshard convert` would plan its rank file
// (PlanRank over the model's view of the source, reshard/plan/rank_plan.h), so its header
// describes the same tensors (names, dtypes, global and local shapes, rows, flat objects) and
// reshard.load checks the model against it as against a rank file. Load then fills each
// target through the one byte map (MapEntry, ExpandConversion, FillEntry: reshard/plan/),
// piece by piece, reading only the source bytes this rank owns (the rows of an FSDP2 shard are
// one contiguous range of each source tensor), landing host targets in place and device
// targets through the copier's pinned staging.
//
// Checksums: a Hugging Face checkpoint has none. Rank files of another layout are read a
// whole chunk at a time and every chunk read is checked against its chunk_xxh3 (and decoded
// when zstd), even when only part of it is needed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>

#include "reshard/format/layout.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/runtime/device_copier.h"
#include "reshard/runtime/loader.h"

namespace reshard {

class HeaderCache;  // reshard/io/rank_file.h
struct ParallelPlan;  // reshard/format/parallel_plan.h

class SourceRankView {
 public:
  virtual ~SourceRankView() = default;

  /// Rank `rank` of `layout` planned over the Hugging Face checkpoint at `src` (a directory
  /// or a weight file). `model_manifest_json`: a model manifest (formats/model-manifest.md)
  /// whose conversion maps the checkpoint's keys to the model's names and shapes, when they
  /// differ, and which FSDP1 layouts are planned from (required for them); `whole`: the
  /// names (model's, or the checkpoint's) of tensors stored whole on every rank of an FSDP2
  /// layout rather than sharded (persistent buffers: FSDP2 does not shard buffers; the
  /// manifest's persistent buffers are added, as convert adds them). Throws
  /// what OpenCheckpoint and the planners throw, and kUnsupported for conversions the
  /// capture refused. A DTensor layout (layout.kind kDTensor) is planned by `plan` (its
  /// name and xxh3 are the layout's; `plan_path` names it in errors), required then.
  static std::unique_ptr<SourceRankView> OfCheckpoint(const std::filesystem::path& src,
                                                      const LayoutSpec& layout, uint32_t rank,
                                                      const std::set<std::string>& whole,
                                                      const std::string& model_manifest_json = "",
                                                      const ParallelPlan* plan = nullptr,
                                                      const std::string& plan_path = "");

  /// Rank `rank` of `layout` planned over layout `key` (any kind, any world size) of the
  /// reshard output `out`: every rank file of `key` is opened, checked to be the one
  /// OUT/reshard.json lists, and described (DescribeLayoutTensors); `whole` and the model
  /// manifest (FSDP1 targets; its conversion is not used: the layout holds the model's
  /// names) as above. Throws kNotFound (no such layout, a missing rank file), kMismatch (an
  /// incomplete layout, a file that is not the listed one), kDataLoss (a corrupt header).
  static std::unique_ptr<SourceRankView> OfLayout(const std::filesystem::path& out,
                                                  const std::string& key, const LayoutSpec& layout,
                                                  uint32_t rank, const std::set<std::string>& whole,
                                                  const std::string& model_manifest_json = "",
                                                  HeaderCache* headers = nullptr,
                                                  const ParallelPlan* plan = nullptr,
                                                  const std::string& plan_path = "");

  /// The planned rank file's header: tensors (name, dtype, shapes, rows, flat, nbytes), the
  /// layout fields; no offsets or checksums (nothing is stored).
  virtual const RankFileHeader& header() const = 0;
  /// What the bytes come from, for reports and errors: "Hugging Face checkpoint DIR" or
  /// "layout KEY of OUT".
  virtual const std::string& description() const = 0;
  /// The files this rank's bytes are read from (weight files, or the other layout's rank
  /// files), in the order the planned tensors first need them.
  virtual std::vector<std::string> files() const = 0;

  /// The file bytes a load of every planned tensor reads: [offset, offset + length) of `path`,
  /// sorted by path and offset, overlapping and adjacent ranges merged. From another layout
  /// these are whole checksum chunks (zstd: whole frames), as a load reads them. What a
  /// benchmark's ceiling for the same reads reads (`reshard_bench_ceilings ranges --list`).
  struct Range {
    std::string path;
    uint64_t offset = 0, length = 0;
  };
  virtual std::vector<Range> ReadRanges() const = 0;

  /// The planned tensors whose bytes change dtype while read (the layout's dtype policy over
  /// a source of another dtype: bf16 files into an fp32 job), for reports.
  virtual size_t ConvertedTensors() const = 0;

  /// Loads `targets` (a subset of header().tensors, each named once, nbytes equal) as
  /// LoadRankFile does: host targets in place, device targets through `copier` (options:
  /// threads = reader threads and copier lanes, slots_per_thread; span_bytes is the piece
  /// read at once; verify_checksums applies to rank-file sources). Throws reshard::Error
  /// naming the file on a short read, a checksum mismatch, a bad frame; the targets must then
  /// be treated as not loaded.
  virtual LoadStats Load(std::span<const LoadTarget> targets, DeviceCopier* copier,
                         const LoadOptions& options) const = 0;
};

}  // namespace reshard
