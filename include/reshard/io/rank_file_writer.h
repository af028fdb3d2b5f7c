// Writing one rank file: the one writer of rank files, used by `reshard convert`
// (reshard/ops/convert.h) and by reshard.save (SaveRankFile, reshard/runtime/rank_writer.h).
//
// RankFileWriter lays out the data region from the tensor entries it is given (every tensor
// at a multiple of 4096, in the given order), takes each tensor's bytes, hashes them per
// chunk, and on Commit writes the header at the end, then the preamble, fsyncs, checks the
// file with the reader, and renames the temporary file into place (formats/rank-file.md,
// Atomicity). Until Commit succeeds nothing exists under the final name; a writer destroyed
// without Commit removes its temporary.
//
// Raw codec: every chunk has a fixed place. Bytes arrive through Append (a tensor's bytes in
// order, in pieces of any size) or as whole chunks (EncodeChunk + WriteChunk, in any order
// and from several threads at once).
// zstd codec: every chunk of a non-empty tensor is one independent frame (ChunkEncoder),
// appended after the frame before it: a tensor starts at the next multiple of 4096 when its
// chunk 0 arrives, so chunks must arrive in file order (WriteChunk says how).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/format/rank_file_format.h"
#include "reshard/io/file_io.h"

namespace reshard {

/// ".tmp-<host>-<pid>": the suffix of a rank file's temporary name (formats/rank-file.md).
std::string RankFileTempSuffix();

/// Removes the rank-file temporaries (".rank-...tmp-<host>-<pid>", or the older
/// "...tmp-<pid>") that dead writers on this host left in `dir`; with `for_file`, only those
/// of that final file name. A live process's, or another host's, are left alone. Convert
/// calls it for its layout directories, a save for the file it writes (a killed save's
/// full-size temporary does not outlive the save that replaces it).
void RemoveStaleTemporaries(const std::filesystem::path& dir, std::string_view for_file = {});

/// Makes the stored form of chunks for one codec; one per thread (it owns the zstd context
/// and a frame buffer of ZSTD_compressBound(chunk_size) bytes).
class ChunkEncoder {
 public:
  ChunkEncoder(Codec codec, uint64_t chunk_size, int zstd_level = 3);
  ChunkEncoder(ChunkEncoder&&) noexcept;
  ChunkEncoder& operator=(ChunkEncoder&&) noexcept;
  ~ChunkEncoder();

  Codec codec() const { return codec_; }
  /// The stored form of `n` (at most chunk_size) bytes at `data`: raw, those bytes
  /// themselves; zstd, one frame in this encoder's buffer, valid until the next call.
  /// Throws kIo when compression fails.
  std::span<const char> Encode(const void* data, uint64_t n);

 private:
  struct Zstd;
  Codec codec_;
  uint64_t chunk_size_;
  int level_;
  std::unique_ptr<Zstd> zstd_;
};

struct RankFileWriterOptions {
  /// The codec of every non-empty tensor (empty tensors are raw).
  Codec codec = Codec::kRaw;
  /// Commit fsyncs the directory after its rename; false when the caller does so once after
  /// a batch of commits into one directory.
  bool sync_directory = true;
};

/// Append writes in pieces of this many bytes, each handed to the disk as soon as it is
/// written (File::StartWriteback).
inline constexpr uint64_t kWritebackPiece = 64ull << 20;

class RankFileWriter {
 public:
  /// Starts writing `final_path` under a temporary name in the same directory (which must
  /// exist). `header` gives the layout, rank, source and chunk size, and one entry per tensor
  /// with name, dtype, global_shape, sharded, rows, local_shape and flat; nbytes, offsets,
  /// codec, sizes and checksums are filled in here. The entries are checked with the reader's
  /// own rules (invariants 3–7: unique names, shard rule, shapes, whole bytes) before
  /// anything is written; a violation throws kInvalidArgument naming the field.
  static RankFileWriter Create(const std::filesystem::path& final_path, RankFileHeader header,
                               const RankFileWriterOptions& options = {});

  RankFileWriter(RankFileWriter&&) noexcept;
  RankFileWriter& operator=(RankFileWriter&&) noexcept;
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;
  /// Removes the temporary file unless Commit succeeded.
  ~RankFileWriter();

  /// The header as it stands (nbytes are final, raw offsets too; checksums, and zstd offsets
  /// and frames, only after Commit).
  const RankFileHeader& header() const { return header_; }
  const std::filesystem::path& temp_path() const { return tmp_path_; }
  const std::filesystem::path& final_path() const { return final_path_; }
  Codec codec() const { return options_.codec; }
  /// Index of tensor `name` in header().tensors; throws kInvalidArgument when absent.
  size_t IndexOf(std::string_view name) const;

  /// Raw codec only. Appends the next `n` bytes of tensor `index` (its bytes arrive in order,
  /// in pieces of any size; tensors may be interleaved; one thread at a time). Throws
  /// kInvalidArgument past the tensor's nbytes, kIo when the write fails.
  void Append(size_t index, const void* data, uint64_t n);

  /// Bytes of tensor `index` written so far (by Append or by WriteChunk).
  uint64_t Written(size_t index) const;

  /// Records the checksum of whole chunk `chunk` of tensor `index` from its decoded bytes
  /// (`data`, ChunkLength of them) and returns its stored form made by `encoder` (of this
  /// writer's codec), for WriteChunk. Any thread, any order, concurrently for different
  /// chunks.
  std::span<const char> EncodeChunk(size_t index, uint64_t chunk, const void* data,
                                    ChunkEncoder& encoder);

  /// Writes the stored form of chunk `chunk` of tensor `index` (from EncodeChunk).
  /// Raw: at the chunk's place; any thread, any order, concurrently for different chunks.
  /// zstd: appended after the last frame written; calls must not overlap, and come in the
  /// order the frames are to lie in the file: tensor by tensor in header order, each
  /// tensor's chunks in order. Throws kIo when the write fails.
  void WriteChunk(size_t index, uint64_t chunk, std::span<const char> stored);

  /// Finishes the file: every tensor must be complete (kInvalidArgument otherwise). Writes
  /// header and preamble, fsyncs, re-opens the temporary with RankFileReader (invariants 1–7)
  /// and, with `verify_data`, re-reads every chunk against its checksum (invariant 8); only
  /// then renames it into place and (options.sync_directory) fsyncs the directory. Any
  /// failure throws, leaves nothing under the final name, and removes the temporary. Returns
  /// the final file's size.
  uint64_t Commit(bool verify_data = false);

 private:
  RankFileWriter();
  struct Progress;
  void Abort() noexcept;
  void Store(size_t index, uint64_t at, const void* data, uint64_t n);  // raw: hash + write

  std::filesystem::path final_path_, tmp_path_;
  RankFileHeader header_;
  RankFileWriterOptions options_;
  uint64_t data_size_ = 0;  // raw: fixed by Create
  uint64_t cursor_ = 0;     // zstd: next free byte of the data region
  File file_;
  std::unique_ptr<Progress[]> progress_;
  bool committed_ = false;
};

}  // namespace reshard
