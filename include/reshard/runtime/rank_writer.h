// Writing rank files from tensors in memory (host or device): the reusable writer behind
// reshard.save, and the manifest of a checkpoint saved from training.
//
// RankFileWriter lays out the data region from the tensor entries it is given (raw codec,
// every tensor at a multiple of 4096, in the given order), takes each tensor's bytes in
// order, hashes them per chunk as they arrive, and on Commit writes the header at the end,
// then the preamble, fsyncs, and renames the temporary file into place (formats/rank-file.md,
// Atomicity). Until Commit succeeds nothing exists under the final name; a writer destroyed
// without Commit removes its temporary.
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
#include "reshard/io/file_io.h"
#include "reshard/runtime/device_copier.h"

namespace reshard {

/// ".tmp-<host>-<pid>": the suffix of a rank file's temporary name (formats/rank-file.md).
std::string RankFileTempSuffix();

class RankFileWriter {
 public:
  /// Starts writing `final_path` under a temporary name in the same directory (which must
  /// exist). `header` gives the layout, rank, source and chunk size, and one entry per tensor
  /// with name, dtype, global_shape, sharded, rows and local_shape; nbytes, offsets, sizes and
  /// checksums are filled in here. The entries are checked with the reader's own rules
  /// (invariants 3–7: unique names, shard rule, shapes, whole bytes) before anything is
  /// written; a violation throws kInvalidArgument naming the field.
  static RankFileWriter Create(const std::filesystem::path& final_path, RankFileHeader header);

  RankFileWriter(RankFileWriter&&) noexcept;
  RankFileWriter& operator=(RankFileWriter&&) noexcept;
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;
  /// Removes the temporary file unless Commit succeeded.
  ~RankFileWriter();

  /// The header as it stands (offsets and nbytes are final; checksums only after Commit).
  const RankFileHeader& header() const { return header_; }
  const std::filesystem::path& temp_path() const { return tmp_path_; }
  const std::filesystem::path& final_path() const { return final_path_; }
  /// Index of tensor `name` in header().tensors; throws kInvalidArgument when absent.
  size_t IndexOf(std::string_view name) const;

  /// Appends the next `n` bytes of tensor `index` (its bytes arrive in order, in pieces of
  /// any size; tensors may be interleaved). Throws kInvalidArgument past the tensor's nbytes,
  /// kIo when the write fails.
  void Append(size_t index, const void* data, uint64_t n);

  /// Bytes of tensor `index` appended so far.
  uint64_t Written(size_t index) const;

  /// Finishes the file: every tensor must be complete (kInvalidArgument otherwise). Writes
  /// header and preamble, fsyncs, re-opens the temporary with RankFileReader (invariants 1–7)
  /// and, with `verify_data`, re-reads every chunk against its checksum (invariant 8); only
  /// then renames it into place and fsyncs the directory. Any failure throws, leaves nothing
  /// under the final name, and removes the temporary. Returns the final file's size.
  uint64_t Commit(bool verify_data = false);

 private:
  RankFileWriter() = default;
  struct Progress;
  void Abort() noexcept;

  std::filesystem::path final_path_, tmp_path_;
  RankFileHeader header_;
  uint64_t data_size_ = 0;
  File file_;
  std::vector<Progress> progress_;
  bool committed_ = false;
};

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
/// already in OUT must have the same source (kMismatch otherwise). Returns the entry.
ManifestLayout WriteSavedManifest(const std::filesystem::path& out, const LayoutSpec& layout,
                                  const SourceFingerprint& source,
                                  const std::vector<std::string>& aux_files);

}  // namespace reshard
