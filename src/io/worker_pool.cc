#include "reshard/io/worker_pool.h"

#include <algorithm>
#include <string>
#include <system_error>
#include <utility>

#include "reshard/base/error.h"

namespace reshard {

WorkerPool::WorkerPool(unsigned threads) {
  threads = std::max(1u, threads);
  threads_.reserve(threads);
  try {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this, i] { Loop(i); });
  } catch (const std::system_error& e) {
    Stop();  // the threads already started
    Fail(ErrorCode::kIo, "cannot start " + std::to_string(threads) + " reader threads: " + e.what());
  }
}

WorkerPool::~WorkerPool() { Stop(); }

void WorkerPool::Stop() noexcept {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void WorkerPool::Run(unsigned n, const std::function<void(unsigned)>& fn) {
  if (n > size()) {
    Fail(ErrorCode::kInvalidArgument, "WorkerPool::Run: " + std::to_string(n) +
                                          " jobs for a pool of " + std::to_string(size()) + " threads");
  }
  if (n == 0) return;
  std::unique_lock<std::mutex> g(mu_);
  if (running_) Fail(ErrorCode::kInvalidArgument, "WorkerPool::Run: the pool is already running a job");
  running_ = true;
  fn_ = &fn;
  want_ = n;
  remaining_ = n;
  error_ = nullptr;
  ++generation_;
  work_cv_.notify_all();
  done_cv_.wait(g, [this] { return remaining_ == 0; });
  running_ = false;
  fn_ = nullptr;
  std::exception_ptr error = std::exchange(error_, nullptr);
  g.unlock();
  if (error) std::rethrow_exception(error);
}

void WorkerPool::Loop(unsigned index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    work_cv_.wait(g, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index >= want_) continue;
    const std::function<void(unsigned)>* fn = fn_;
    g.unlock();
    std::exception_ptr error;
    try {
      (*fn)(index);
    } catch (...) {
      error = std::current_exception();
    }
    g.lock();
    if (error && !error_) error_ = error;
    if (--remaining_ == 0) done_cv_.notify_all();
  }
}

}  // namespace reshard
