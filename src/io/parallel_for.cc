#include "reshard/io/parallel_for.h"

#include "reshard/base/cancel.h"
#include "reshard/base/error.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>


namespace reshard {

unsigned ParallelThreads(size_t n, unsigned threads) {
  const unsigned want = threads ? threads : std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(want, n)));
}

// The shared state of one RunParallelFor.
class ParallelForRun {
 public:
  ParallelForRun(size_t n, const ParallelForOptions& o) : n_(n), options_(o) {}

  bool Next(size_t& index) {
    if (failed_.load(std::memory_order_relaxed)) return false;
    if (CancelSignal() != 0) {  // Ctrl-C: the loop ends with Error(kCancelled)
      Record(std::make_exception_ptr(Error(ErrorCode::kCancelled, "interrupted by " + CancelSignalName())));
      return false;
    }
    index = next_.fetch_add(1);
    return index < n_;
  }

  void Done(uint64_t units) {
    done_.fetch_add(units);
    if (!options_.progress) return;
    // Skipped while another thread reports; the value read under the lock only grows, so
    // the reports are monotonic whichever thread makes them.
    std::unique_lock<std::mutex> report(progress_mu_, std::try_to_lock);
    if (report.owns_lock()) options_.progress(done_.load());
  }

  void Record(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(error_mu_);
    if (!error_) error_ = std::move(e);
    failed_ = true;
  }

  void Main(const std::function<void(ParallelForThread&)>& thread_main) {
    ParallelForThread thread(*this);
    try {
      thread_main(thread);
    } catch (...) {
      Record(std::current_exception());
    }
  }

  void Finish() {
    if (error_) std::rethrow_exception(error_);
    if (options_.progress) options_.progress(done_.load());
  }

 private:
  const size_t n_;
  const ParallelForOptions& options_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> done_{0};
  std::mutex error_mu_, progress_mu_;
  std::exception_ptr error_;
};

bool ParallelForThread::Next(size_t& index) { return run_.Next(index); }

void ParallelForThread::Done(uint64_t units) { run_.Done(units); }

void RunParallelFor(size_t n, const ParallelForOptions& options,
                    const std::function<void(ParallelForThread&)>& thread_main) {
  ParallelForRun run(n, options);
  const unsigned threads = ParallelThreads(n, options.threads);
  std::vector<std::thread> others;
  others.reserve(threads - 1);
  try {
    for (unsigned t = 1; t < threads; ++t) others.emplace_back([&] { run.Main(thread_main); });
  } catch (const std::system_error&) {
    // Out of threads: those already started and this one take every item all the same.
  }
  run.Main(thread_main);
  for (auto& t : others) t.join();
  run.Finish();
}

}  // namespace reshard
