// The read pipeline: executes a LoadPlan (reshard/runtime/load_plan.h) with reader threads,
// staging slots and the device copier. Each reader thread (a ReaderLane, one per copier
// lane) takes the next span of the plan's queue, reads it (checking checksums, decoding zstd
// frames), and lands it in host memory or copies it from one of its staging slots to the
// device asynchronously while it reads the next span. Errors: the first one wins; the other
// threads stop at their next span; it is rethrown once every thread has returned and the
// copies in flight are done.
#pragma once

#include <chrono>
#include <system_error>
#include <thread>
#include <string>
#include <vector>

#include "reshard/io/file_io.h"
#include "reshard/io/worker_pool.h"
#include "reshard/runtime/device_copier.h"
#include "reshard/runtime/load_plan.h"

namespace reshard {

/// Where a plan's bytes come from.
struct PlanSource {
  const std::string* path = nullptr;  // for messages
  const File* buffered = nullptr;     // the file, buffered reads
  const File* direct = nullptr;       // the file opened O_DIRECT, or null: buffered reads only
  bool readahead = false;             // one more thread asks the kernel to read ahead
};

/// What one reader thread did, for LoadDiagnostics (kept only when asked for). Times in
/// seconds since the load's start; durations summed over the thread's spans.
struct LaneTimes {
  double start = 0, end = 0;  // when it started (woken) and ran out of spans
  double first_copy = -1;     // when it issued its first copy to the device (-1: none)
  double wait = 0;            // blocked on a staging slot whose copy was in flight
  double read = 0;            // reading (and hashing) raw spans bound for the device
  double issue = 0;           // issuing copies
  double cpu = 0;             // CPU time of the thread from start to end
  long involuntary = 0;       // involuntary context switches from start to end
  int start_cpu = -1;         // the CPU it started on
};

/// What the run of a plan reports.
struct PipelineResult {
  bool pooled = false;           // the reader threads came from the pool
  // With timing only (RunPlan's `timed`):
  std::vector<LaneTimes> lanes;  // one per reader thread
  double reads_done = 0;         // when the last reader thread finished
  double sync = 0;               // then waiting for the copies still in flight
};

/// Runs `plan` to the end: plan.lanes reader threads (on `pool` when it is given and has that
/// many, else started for the run), one read-ahead thread when source.readahead, then the
/// copier's Synchronize when the plan has device targets (staging already reserved). Throws
/// the first error. `timed`: keep the diagnostics' timers (since `t0`); without it the data
/// path reads no clock.
PipelineResult RunPlan(const LoadPlan& plan, const PlanSource& source, DeviceCopier* copier,
                       WorkerPool* pool, bool timed, std::chrono::steady_clock::time_point t0);

/// Calls lane(i) for i in [0, n) on n threads: the pool's when it has that many (started once,
/// so this run starts none), else n - 1 started here and the calling thread. True: pooled.
/// lane must not throw (a started thread cannot pass an exception on; record it instead).
/// When the system refuses a thread, the lanes it would have run run on the calling thread
/// after lane 0; the started threads are joined on every path (a joinable std::thread
/// destroyed would end the process).
template <typename LaneFn>
bool RunLanes(unsigned n, WorkerPool* pool, LaneFn&& lane) {
  if (pool != nullptr && pool->size() >= n) {
    pool->Run(n, [&](unsigned i) { lane(static_cast<int>(i)); });
    return true;
  }
  struct Joined {
    std::vector<std::thread> threads;
    ~Joined() {
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } started;
  unsigned t = 1;
  try {
    for (; t < n; ++t) started.threads.emplace_back([&lane, t] { lane(static_cast<int>(t)); });
  } catch (const std::system_error&) {
    // Out of threads: the remaining lanes run here.
  }
  lane(0);
  for (; t < n; ++t) lane(static_cast<int>(t));
  return false;
}

}  // namespace reshard
