// A fixed set of started threads that run one parallel job at a time. The loader's reader
// threads come from one when the caller keeps a pool (the Python module keeps one per copy
// engine, started by reshard.prepare), so a load does not pay for starting threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace reshard {

class WorkerPool {
 public:
  /// Starts `threads` threads (at least 1), which sleep until Run gives them work.
  explicit WorkerPool(unsigned threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(threads_.size()); }

  /// Calls fn(i) for every i in [0, n) (n <= size()), each on its own pool thread, and
  /// returns when all have returned; rethrows the first exception one of them threw. One
  /// Run at a time (callers serialise; a second concurrent Run throws).
  void Run(unsigned n, const std::function<void(unsigned)>& fn);

 private:
  void Loop(unsigned index);
  void Stop() noexcept;  // ends and joins every started thread

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(unsigned)>* fn_ = nullptr;
  unsigned want_ = 0;         // threads [0, want_) take part in the current job
  unsigned remaining_ = 0;    // of those, how many have not finished
  uint64_t generation_ = 0;   // bumped by every Run
  bool running_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace reshard
