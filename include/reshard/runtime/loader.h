// Loading one rank file into caller-owned memory: the run-time half of reshard.
//
// The loader is pipelined: reader threads take chunks in file order, read them (O_DIRECT
// when the file is not in the page cache), check their checksums, decompress zstd frames,
// and either land them in host memory directly or hand them to a DeviceCopier, which copies
// from pinned staging buffers to device memory asynchronously while the thread reads the
// next chunk. This header has no CUDA dependency: the CUDA copier lives in src/cuda.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "reshard/io/rank_file.h"
#include "reshard/io/worker_pool.h"
#include "reshard/runtime/device_copier.h"

namespace reshard {

struct LoadTarget {
  std::string name;      // tensor name in the rank file
  void* ptr = nullptr;   // destination (contiguous, nbytes long)
  uint64_t nbytes = 0;   // must equal the file's nbytes for the tensor
  bool on_device = false;
};

/// kAuto: buffered reads when the file is in the page cache; when it is not, kDirect for a
/// load whose targets are all on the device, else kReadahead.
/// kReadahead: buffered reads by the workers while one thread asks the kernel to read ahead
/// (posix_fadvise WILLNEED) in file order, so the disk sees one sequential stream.
/// kDirect: O_DIRECT reads into the staging buffers (a rank file: device targets only; a load
/// without the rank file, SourceRankView: host targets too, through DirectReader).
enum class IoMode { kAuto, kBuffered, kDirect, kReadahead };

struct LoadOptions {
  unsigned threads = 8;
  unsigned slots_per_thread = 2;
  bool verify_checksums = true;  // off only to benchmark the raw path
  IoMode io = IoMode::kAuto;
  /// What a reader thread takes at once from a file in the page cache: consecutive raw
  /// chunks bound for the device (of one tensor or of tensors adjacent in the file) up to
  /// this many bytes, read with one pread into one staging slot and copied with one
  /// cudaMemcpyAsync per tensor. 0: one chunk at a time; a chunk longer than this is read
  /// on its own. 4 MiB: larger copies keep the copy engine nearer its peak (pinned H2D of
  /// 2 MiB copies 50.8 GB/s, 4 MiB 52.2, 64 MiB 54.7 on the H200; bench/HISTORY.md §7 run J).
  uint64_t span_bytes = 4ull << 20;
  /// The same, and the number of reader threads (0: `threads`; never more), for a file read from disk
  /// (kDirect, kReadahead, or kAuto finding it out of the page cache): fewer, larger
  /// sequential requests suit disks (bench/HISTORY.md §7). A load without the rank file
  /// (SourceRankView) reading O_DIRECT uses up to twice cold_threads: its reads are scattered
  /// (bench/HISTORY.md §14).
  uint64_t cold_span_bytes = 4ull << 20;
  unsigned cold_threads = 8;
  /// For a file in the page cache, with checksums on: each chunk is read in pieces of this
  /// many bytes, each hashed right after it is read, while it is still in the core's cache
  /// (0: read the whole span, then hash it).
  uint64_t hash_piece_bytes = 256ull << 10;
  /// For a file in the page cache: the first span each reader thread takes in a load is
  /// copied to the device in parts as it is read, the first part once this many bytes are
  /// in, each next part twice as long, so that the device starts copying before whole spans
  /// are in (0: whole spans only). A part may be copied before the rest of its chunk has been
  /// checked; a checksum mismatch still fails the load. 1 MiB: the first copy starts after
  /// ~0.4 ms instead of ~0.9 ms; 0.46 GB rank file +1-8 %, multi-GB files unchanged
  /// (bench/HISTORY.md §7, runs M and N).
  uint64_t lead_in_bytes = 1ull << 20;
  /// Run the reader threads on these (already started) threads rather than starting new
  /// ones for this load; ignored when it has fewer threads than the load wants.
  WorkerPool* pool = nullptr;
  /// When set, the decoded bytes of every span (rank files) or piece (views) are added here
  /// once they have landed (host) or been handed to the copier (device), for a progress
  /// display polled by another thread (reshard.load(progress=True)). One relaxed add per span.
  std::atomic<uint64_t>* progress = nullptr;
};

/// What every load reports (reshard.load's LoadStats).
struct LoadStats {
  uint64_t bytes = 0;          // decoded bytes landed in the targets
  uint64_t stored_bytes = 0;   // bytes read from the file (compressed size for zstd)
  uint64_t tensors = 0;
  double seconds = 0;
  uint64_t staging_bytes = 0;  // pinned staging the load's plan uses (lanes × slots × slot)
  double staging_alloc_seconds = 0;  // of `seconds`: allocating staging (0 when it was reused)
  unsigned threads = 0;        // reader threads (= copier lanes used)
  bool pooled = false;         // the reader threads came from LoadOptions::pool
  bool cold = false;           // read as a file on disk (cold_threads / cold_span_bytes)
  bool direct_io = false;      // O_DIRECT reads
};

/// How a load went, for benchmarks (reshard._C._testing.load_raw): filled only when the
/// caller passes one to LoadRankFile; without it the read path reads no clock.
struct LoadDiagnostics {
  uint64_t span_bytes = 0;       // largest span a thread read at once
  bool readahead = false;        // buffered reads with one thread asking to read ahead
  double resident_fraction = 0;  // page-cache residency measured for kAuto
  double residency_seconds = 0;  // of `seconds`: probing the page cache (kAuto)
  double sync_seconds = 0;       // of `seconds`: waiting for the last copies after the reads
  // Raw spans bound for the device, averaged over the reader threads: seconds reading (and
  // hashing) them, and seconds waiting for a staging slot whose copy was still in flight.
  double read_seconds = 0;
  double wait_seconds = 0;
  // Of `seconds`, from the start of the load: when the first copy to the device was issued
  // (the pipeline's fill), and when the last reader thread finished (what follows is
  // sync_seconds: the copies still in flight).
  double first_copy_seconds = 0;
  double reads_done_seconds = 0;
  // Diagnostics of the reader threads: the latest start (the slowest to wake), the average
  // time a thread ran out of work (reads_done_seconds minus this is the end's imbalance),
  // and the seconds a thread spent issuing copies, averaged (a lead-in's copies are issued
  // while the span is read, so their time is in read_seconds too).
  double lane_start_seconds = 0;
  double lane_end_seconds = 0;
  double issue_seconds = 0;
  // Scheduling of the reader threads, averaged over them: the time from a thread's start
  // to its end, and the CPU time it used in it (the difference: time it was not on a CPU,
  // descheduled or blocked, e.g. in a read from disk); the involuntary context switches of
  // all of them, and how many started on a CPU another reader also started on.
  double lane_wall_seconds = 0;
  double lane_cpu_seconds = 0;
  uint64_t preemptions = 0;
  unsigned lanes_on_shared_cpus = 0;
};

/// The span limit (LoadOptions::span_bytes or cold_span_bytes) and the reader threads (=
/// copier lanes used) of a warm or cold load with these options.
uint64_t SpanLimit(const LoadOptions& options, bool cold);
unsigned LaneCount(const LoadOptions& options, bool cold);

/// Staging bytes per (lane, slot) for a copier of `options.threads` lanes such that both a
/// warm and a cold load of files with chunks of `chunk_size` bytes find it large enough
/// (Reserve(PreparedSlotBytes(o, cs), o.threads) before either load allocates nothing).
uint64_t PreparedSlotBytes(const LoadOptions& options, uint64_t chunk_size);

/// Loads `targets` (a subset of the file's tensors, each named once) from `file`. Targets
/// with on_device need `copier`. Throws reshard::Error on a short read, checksum mismatch,
/// bad frame, unknown name, size mismatch, or device error; when it throws, targets may
/// hold partial data and must be treated as not loaded. `diagnostics`: when given, filled
/// with the load's timings (the reader threads then read clocks).
///
/// Steps: ResolveTargets, ChooseIo and PlanLoad (reshard/runtime/load_plan.h, pure), the
/// copier's Reserve of the plan's staging, then the read pipeline (src/runtime/read_pipeline.h).
LoadStats LoadRankFile(const RankFileReader& file, std::span<const LoadTarget> targets,
                       DeviceCopier* copier, const LoadOptions& options,
                       LoadDiagnostics* diagnostics = nullptr);

}  // namespace reshard
