// WorkerPool: every index runs once per Run on a pool thread, Runs follow one another,
// errors come back to the caller, and misuse is refused.
#include "reshard/io/worker_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"

namespace reshard {
namespace {

TEST(WorkerPool, RunsEveryIndexOnceOnPoolThreads) {
  WorkerPool pool(4);
  EXPECT_EQ(pool.size(), 4u);
  for (unsigned n : {4u, 1u, 3u, 0u, 4u}) {
    std::vector<std::atomic<int>> calls(4);
    std::mutex mu;
    std::set<std::thread::id> ids;
    pool.Run(n, [&](unsigned i) {
      calls[i]++;
      std::lock_guard<std::mutex> g(mu);
      ids.insert(std::this_thread::get_id());
    });
    for (unsigned i = 0; i < 4; ++i) EXPECT_EQ(calls[i].load(), i < n ? 1 : 0) << "n " << n << " i " << i;
    EXPECT_EQ(ids.size(), n);
    EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
  }
}

TEST(WorkerPool, ManyRunsInARow) {
  WorkerPool pool(3);
  std::atomic<int> total{0};
  for (int r = 0; r < 2000; ++r) pool.Run(3, [&](unsigned i) { total += static_cast<int>(i) + 1; });
  EXPECT_EQ(total.load(), 2000 * 6);
}

TEST(WorkerPool, RethrowsAWorkersErrorAndStaysUsable) {
  WorkerPool pool(3);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.Run(3,
                        [&](unsigned i) {
                          ran++;
                          if (i == 1) throw std::runtime_error("lane 1 failed");
                        }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 3);  // the others still ran to the end
  ran = 0;
  pool.Run(3, [&](unsigned) { ran++; });
  EXPECT_EQ(ran.load(), 3);
}

TEST(WorkerPool, RefusesMoreJobsThanThreadsAndANestedRun) {
  WorkerPool pool(2);
  EXPECT_TRUE(test::ThrowsError([&] { pool.Run(3, [](unsigned) {}); }, ErrorCode::kInvalidArgument,
                                {"3 jobs for a pool of 2 threads"}));
  EXPECT_TRUE(test::ThrowsError([&] { pool.Run(1, [&](unsigned) { pool.Run(1, [](unsigned) {}); }); },
                                ErrorCode::kInvalidArgument, {"already running"}));
}

}  // namespace
}  // namespace reshard
