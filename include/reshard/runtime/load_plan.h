// What a load will do, decided before it reads a byte: the loader's span planner. Pure: it
// works on the header and the targets only (no file, no thread, no copier), so that the exact
// spans, copies and staging of a load can be unit-tested (tests/core/runtime/load_plan_test.cc).
// The read pipeline (src/runtime/read_pipeline.h) executes a plan; LoadRankFile (loader.h)
// resolves the targets, picks the read mode, plans, and runs the pipeline.
//
// What stays dynamic, decided while reading: which reader thread takes which span (threads
// take the next span of the queue in file order as they come free, which balances them), and
// so which span is a thread's first (its lead-in, below) and which staging slot a span lands
// in (each thread cycles through its own slots, one per span bound for the device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "reshard/format/rank_file_format.h"
#include "reshard/runtime/loader.h"

namespace reshard {

/// One target matched with its tensor in the header.
struct LoadJob {
  const TensorEntry* entry = nullptr;
  const LoadTarget* target = nullptr;
};

/// The targets of a load checked against the file's header.
struct LoadJobs {
  std::vector<LoadJob> jobs;  // in file order (by the tensors' offsets)
  uint64_t bytes = 0;         // decoded bytes of the targets
  uint64_t stored_bytes = 0;  // their bytes in the file (compressed size for zstd)
  bool any_device = false;    // a non-empty target in device memory
  bool all_device = true;     // every non-empty target in device memory
};

/// Checks `targets` against `header`: each names a tensor of the file, once, with the
/// tensor's nbytes and a destination; one in device memory needs a copier (`have_copier`).
/// Throws reshard::Error as LoadRankFile documents, naming `path`.
LoadJobs ResolveTargets(const RankFileHeader& header, std::span<const LoadTarget> targets,
                        bool have_copier, std::string_view path);

/// How the file is read, decided from the options and the page cache (LoadRankFile probes
/// it for kAuto). `direct` is a wish: where the file system refuses O_DIRECT the loader falls
/// back to buffered reads (with read-ahead under kAuto).
struct IoChoice {
  bool direct = false;     // O_DIRECT reads into the staging (device targets only)
  bool readahead = false;  // buffered reads, one thread asking the kernel to read ahead
  bool cold() const { return direct || readahead; }  // read as a file on disk
};
/// `resident_fraction`: the file's page-cache residency (read for kAuto only).
IoChoice ChooseIo(IoMode io, double resident_fraction, const LoadJobs& jobs);

/// The kind of a span, and so what a reader thread does with it.
enum class SpanKind : uint8_t {
  kDeviceRaw,   // raw chunks bound for the device: one read into a staging slot, then copies
  kDeviceZstd,  // one zstd chunk bound for the device: decoded into a staging slot, one copy
  kHostRaw,     // one raw chunk read into its destination
  kHostZstd,    // one zstd chunk decoded into its destination
};

/// One chunk of one target tensor.
struct PlannedChunk {
  uint32_t job = 0;     // index in LoadPlan::jobs
  uint64_t chunk = 0;   // the chunk's index in its tensor
  uint64_t at = 0;      // file offset of its stored bytes (a raw chunk, or a zstd frame)
  uint64_t stored = 0;  // stored length (raw: the decoded length)
  uint64_t length = 0;  // decoded length
  char* dst = nullptr;  // where its decoded bytes land (in the target)
};

/// One copy of a device raw span from its staging slot: file bytes [begin, end), a run of
/// chunks of one tensor (contiguous in the file and in the destination), to `dst`.
struct PlannedCopy {
  uint64_t begin = 0, end = 0;
  char* dst = nullptr;
};

/// What a reader thread takes at once.
struct LoadSpan {
  SpanKind kind = SpanKind::kHostRaw;
  size_t first_chunk = 0, chunk_count = 0;  // LoadPlan::chunks [first, first + count)
  size_t first_copy = 0, copy_count = 0;    // LoadPlan::copies of a device raw span
  uint64_t begin = 0, end = 0;              // its stored bytes in the file
  uint64_t bytes() const { return end - begin; }
};

struct LoadPlan {
  std::vector<LoadJob> jobs;           // in file order
  std::vector<PlannedChunk> chunks;    // every chunk of every job, in file order
  std::vector<PlannedCopy> copies;     // the copies of the device raw spans, in span order
  std::vector<LoadSpan> spans;         // the queue the reader threads take from, file order
  uint64_t bytes = 0, stored_bytes = 0, tensors = 0;
  bool any_device = false;             // the copier is used (staging reserved, threads bound)
  bool cold = false;
  uint64_t span_limit = 0;             // LoadOptions::span_bytes or cold_span_bytes
  unsigned lanes = 1;                  // reader threads (= copier lanes used)
  int slots = 1;                       // staging slots per lane
  uint64_t slot_bytes = 0;             // staging per (lane, slot): the largest span or chunk
  uint64_t staging_bytes = 0;          // lanes × slots × slot_bytes (0 without device targets)
  uint64_t largest_span = 0;           // the largest device raw span (0: none)
  bool verify_checksums = true;        // LoadOptions::verify_checksums
  std::atomic<uint64_t>* progress = nullptr;  // LoadOptions::progress
  /// Warm with checksums: each chunk of a device raw span read in pieces of this many bytes,
  /// each hashed as it is read (0: the span read whole, then hashed).
  uint64_t hash_piece = 0;
  /// Warm: the first part of a lane's first device raw span (LeadIn; 0: no lead-in).
  uint64_t lead_in = 0;
  /// The read size of a span read in pieces: hash_piece, else (a lead-in without checksums)
  /// kLeadInReadBytes.
  uint64_t read_step = 0;
};

/// The read size of a lead-in without checksums.
inline constexpr uint64_t kLeadInReadBytes = 256ull << 10;

/// Plans a load of `jobs` (ResolveTargets of the same header) from a file whose data region
/// starts at `data_offset`, read warm or `cold` (IoChoice::cold()).
///
/// Spans: consecutive raw chunks bound for the device whose bytes are adjacent in the file
/// (tensors start at multiples of 4096, so adjacent tensors leave gaps under 4096 bytes) join
/// one span while it stays within span_limit bytes (0: no joining); a chunk longer than the
/// limit is a span of its own, as is every chunk that is not raw or not bound for the device.
/// A span's copies: one per run of chunks of one tensor. Lanes: LaneCount(options, cold),
/// at most one per span. A staging slot holds one span (raw) or one decoded chunk (zstd),
/// sized by the largest (a header may say 16 GiB chunks: slots follow the data, not the
/// header's chunk size).
LoadPlan PlanLoad(LoadJobs jobs, const RankFileHeader& header, uint64_t data_offset,
                  const LoadOptions& options, bool cold);

/// ResolveTargets, then PlanLoad (for tests and tools that know how the file will be read).
LoadPlan PlanLoad(const RankFileHeader& header, uint64_t data_offset,
                  std::span<const LoadTarget> targets, const LoadOptions& options, bool cold,
                  bool have_copier = true, std::string_view path = "");

/// The lead-in of a lane's first device raw span (warm loads): its bytes are copied in parts
/// as they are read, the first part once `first_part` bytes are in, each next part at least
/// twice as long, so that the device starts copying before the whole span is in; the rest
/// goes with the span's last copy. The pipeline asks after each read (of read_step bytes
/// within a chunk) whether a part is due.
class LeadIn {
 public:
  explicit LeadIn(uint64_t first_part) : part_(first_part) {}
  /// The span's bytes [.., pos) are in and [.., copied) were copied: true when the part
  /// [copied, pos) is to be copied now (never the span's end: that is the last copy).
  bool Due(uint64_t copied, uint64_t pos, uint64_t span_end) {
    if (pos - copied < part_ || pos >= span_end) return false;
    part_ *= 2;
    return true;
  }

 private:
  uint64_t part_;
};

/// Where the lead-in's parts of `span` end (file offsets), as the pipeline reads it when it
/// is a lane's first span; empty without a lead-in. For tests and diagnostics.
std::vector<uint64_t> LeadInCuts(const LoadPlan& plan, const LoadSpan& span);

/// The copies of `span` for its file bytes [from, to): its planned copies clipped to them
/// (a lead-in part, or what follows the last part). Calls copy(dst, offset in the span's
/// staging, bytes) for each non-empty one.
template <typename CopyFn>
void ForEachCopy(const LoadPlan& plan, const LoadSpan& span, uint64_t from, uint64_t to,
                 CopyFn&& copy) {
  for (size_t i = span.first_copy; i < span.first_copy + span.copy_count; ++i) {
    const PlannedCopy& c = plan.copies[i];
    const uint64_t lo = c.begin > from ? c.begin : from;
    const uint64_t hi = c.end < to ? c.end : to;
    if (lo < hi) copy(c.dst + (lo - c.begin), lo - span.begin, hi - lo);
  }
}

}  // namespace reshard
