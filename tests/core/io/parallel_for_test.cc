// ParallelFor (reshard/io/parallel_for.h): every index once, per-thread state, the first
// error ending the loop, progress.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/io/parallel_for.h"

namespace reshard {
namespace {

using test::ThrowsError;

TEST(ParallelFor, EveryIndexOnceWithOneStatePerThread) {
  for (unsigned threads : {1u, 3u, 8u}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{1000}}) {
      SCOPED_TRACE("threads " + std::to_string(threads) + " n " + std::to_string(n));
      std::vector<std::atomic<int>> seen(n);
      std::mutex mu;
      std::set<std::thread::id> thread_ids;
      std::atomic<int> bodies{0};
      ParallelForOptions o;
      o.threads = threads;
      ParallelFor(n, o, [&] {
        ++bodies;
        {
          std::lock_guard<std::mutex> g(mu);
          thread_ids.insert(std::this_thread::get_id());
        }
        // The thread's own state: the indices it took, in the order it took them.
        return [&, mine = std::vector<size_t>()](size_t i) mutable -> uint64_t {
          if (!mine.empty()) EXPECT_GT(i, mine.back()) << "indices are taken in order";
          mine.push_back(i);
          ++seen[i];
          if (i % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
          return 1;
        };
      });
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i], 1) << i;
      const unsigned want = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, n)));
      EXPECT_EQ(ParallelThreads(n, threads), want);
      EXPECT_EQ(bodies, static_cast<int>(want));  // one body per thread, the caller's included
      EXPECT_EQ(thread_ids.size(), want);
      EXPECT_TRUE(thread_ids.count(std::this_thread::get_id()));
    }
  }
  EXPECT_EQ(ParallelThreads(1000, 0), std::max(1u, std::thread::hardware_concurrency()));
}

TEST(ParallelFor, TheFirstErrorStopsTheLoopAndIsRethrown) {
  constexpr size_t kN = 100000;
  std::atomic<size_t> ran{0};
  ParallelForOptions o;
  o.threads = 4;
  std::atomic<int> progress_calls{0};
  o.progress = [&](uint64_t) { ++progress_calls; };
  EXPECT_TRUE(ThrowsError(
      [&] {
        ParallelFor(kN, o, [&] {
          return [&](size_t i) -> uint64_t {
            ++ran;
            if (i == 10) Fail(ErrorCode::kDataLoss, "item 10 is corrupt");
            if (i > 10) std::this_thread::sleep_for(std::chrono::microseconds(20));
            return 1;
          };
        });
      },
      ErrorCode::kDataLoss, {"item 10 is corrupt"}));
  EXPECT_LT(ran, kN / 10) << "items went on after the error";
  // A later error does not replace the first; an error from a thread's set-up counts too.
  std::atomic<int> made{0};
  EXPECT_THROW(ParallelFor(50, o,
                           [&]() -> std::function<uint64_t(size_t)> {
                             if (made++ == 0) throw std::runtime_error("no buffer for this thread");
                             return [](size_t) -> uint64_t { return 0; };
                           }),
               std::runtime_error);
}

TEST(ParallelFor, ProgressOnlyGrowsAndEndsAtTheTotal) {
  for (unsigned threads : {1u, 4u}) {
    std::mutex mu;
    std::vector<uint64_t> reports;
    ParallelForOptions o;
    o.threads = threads;
    o.progress = [&](uint64_t done) {
      std::lock_guard<std::mutex> g(mu);
      reports.push_back(done);
    };
    ParallelFor(500, o, [&] { return [](size_t i) -> uint64_t { return i % 3; }; });
    uint64_t total = 0;
    for (size_t i = 0; i < 500; ++i) total += i % 3;
    ASSERT_FALSE(reports.empty());
    EXPECT_TRUE(std::is_sorted(reports.begin(), reports.end()));
    EXPECT_EQ(reports.back(), total);
    EXPECT_LE(reports.size(), 501u);  // at most once an item, and once at the end
  }
  // No items: still one report, of 0.
  std::vector<uint64_t> reports;
  ParallelForOptions o;
  o.progress = [&](uint64_t done) { reports.push_back(done); };
  ParallelFor(0, o, [] { return [](size_t) -> uint64_t { return 1; }; });
  EXPECT_EQ(reports, std::vector<uint64_t>{0});
}

}  // namespace
}  // namespace reshard
