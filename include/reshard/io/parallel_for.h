// One parallel loop for the whole core: indices [0, n) taken in order from one counter by
// up to `threads` threads (the caller's among them), each thread with its own state, the
// first error ending the loop, and progress reported as items finish. convert, verify and
// export run their chunks through it (the loader has its own pipeline: src/runtime).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace reshard {

struct ParallelForOptions {
  /// Threads to run on, the calling thread included (0: the hardware's concurrency); never
  /// more than there are items.
  unsigned threads = 0;
  /// Called with the units done so far (the sum of what the items returned) after items
  /// finish: from the thread that finished one, serialised, skipped while another thread is
  /// reporting (so the values reported only grow), and once more on the calling thread after
  /// the last item with the final sum (unless an item failed).
  std::function<void(uint64_t done)> progress;
};

/// The threads a ParallelFor of `n` items with `threads` (0: hardware concurrency) runs on.
unsigned ParallelThreads(size_t n, unsigned threads);

/// One thread's side of a loop: the indices it takes and the units it reports.
class ParallelForThread {
 public:
  /// The next index not yet taken; false when none is left or an item has failed.
  bool Next(size_t& index);
  /// An item finished having done `units` of work (for the progress callback).
  void Done(uint64_t units);

 private:
  friend class ParallelForRun;
  explicit ParallelForThread(class ParallelForRun& run) : run_(run) {}
  ParallelForRun& run_;
};

/// Runs thread_main on ParallelThreads(n, options.threads) threads (the calling thread is one
/// of them; the others are started for this call). The first exception thrown by a
/// thread_main stops every thread at its next Next and is rethrown here once all have returned.
void RunParallelFor(size_t n, const ParallelForOptions& options,
                    const std::function<void(ParallelForThread&)>& thread_main);

/// Calls body(i) for every i in [0, n). `make_body()` is called once on each thread, before
/// its first item, and returns that thread's body (a callable owning the thread's buffers;
/// it is destroyed when the thread is done). body(i) returns the units of work item i did
/// (uint64_t, for ParallelForOptions::progress). Errors as RunParallelFor.
template <typename MakeBody>
void ParallelFor(size_t n, const ParallelForOptions& options, MakeBody&& make_body) {
  RunParallelFor(n, options, [&](ParallelForThread& thread) {
    auto body = make_body();
    for (size_t i = 0; thread.Next(i);) thread.Done(body(i));
  });
}

}  // namespace reshard
