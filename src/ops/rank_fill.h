// Writing rank files whose every entry is filled by its byte map (reshard/plan/byte_map.h):
// the one write loop of `reshard convert` (a Hugging Face checkpoint as the source) and
// `reshard reshard` (another layout's rank files, read through reshard/ops/layout_reader.h).
// Internal to ops.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "reshard/format/rank_file_format.h"
#include "reshard/plan/byte_map.h"

namespace reshard {

/// One rank file to write: its planned header (layout fields, rank, source, chunk_size,
/// entries with name/dtype/shapes/rows/flat; sizes, offsets and checksums are laid out by the
/// writer) and, per entry, the map its bytes are filled by.
struct RankFileJob {
  uint32_t rank = 0;
  std::filesystem::path path;  // the final name
  RankFileHeader header;
  std::vector<EntryMap> maps;  // one per header.tensors entry
};

struct RankFillOptions {
  Codec codec = Codec::kRaw;
  int zstd_level = 3;
  unsigned threads = 1;
  /// Added to as chunks are written (decoded bytes), when given; `progress` is then called
  /// now and then from the filling threads.
  std::atomic<uint64_t>* done_bytes = nullptr;
  std::function<void()> progress;
};

struct RankFillStats {
  uint64_t bytes_read = 0;     // source bytes read
  uint64_t bytes_decoded = 0;  // tensor bytes in the written files
  uint64_t bytes_stored = 0;   // bytes written (after compression)
};

/// Writes every job's file (temporary name, fsync, rename; the directory of the first job
/// synced once at the end), chunk by chunk: each chunk filled by FillEntry from `lookup`'s
/// tensors through a SourceRead made once per thread by `make_read`, hashed, encoded, written.
/// Raw chunks are filled in source order; zstd frames are appended in header order. Every
/// map's sources must have been checked (CheckSources). On error no file of the jobs is
/// renamed into place (their temporaries are removed) and the first error is thrown.
/// Memory: per thread, a few buffers of the longest chunk.
RankFillStats WriteRankFiles(std::vector<RankFileJob>& jobs, const SourceLookup& lookup,
                             const std::function<SourceRead()>& make_read,
                             const RankFillOptions& options);

/// Whether `path` is a valid rank file (preamble, header) whose header has the layout
/// fields, rank, source and chunk_size of `want`, every non-empty entry stored with `codec`,
/// and exactly `want`'s entries (name, dtype, shapes, rows, flat), in order: what a re-run
/// need not write again. With `check_data`, also every chunk read and checked against the
/// header's checksum and every padding byte checked (on `threads` threads): a file damaged
/// after it was written (a flipped byte; the header intact) is not up to date, and `damage`,
/// when given, receives what was found (empty when the file is missing or its header differs).
bool RankFileUpToDate(const std::filesystem::path& path, const RankFileHeader& want, Codec codec,
                      bool check_data = false, unsigned threads = 1, std::string* damage = nullptr);

}  // namespace reshard
