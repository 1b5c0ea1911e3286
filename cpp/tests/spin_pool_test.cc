// The engine's spinning thread pool: every index done exactly once, in parts of at least the
// grain, on several threads; exceptions reach the caller; workers that fell asleep wake up.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "model/spin_pool.h"

using namespace cartridges;

TEST(SpinPoolTest, EveryIndexOnceInPartsOfTheGrain) {
  SpinPool pool(3);
  ASSERT_EQ(pool.threads(), 3);
  for (int64_t n : {0, 1, 2, 5, 64, 1000}) {
    for (int64_t grain : {1, 16, 64}) {
      std::vector<std::atomic<int>> hits(n);
      std::mutex mutex;
      std::set<std::thread::id> workers;
      std::vector<std::pair<int64_t, int64_t>> parts;
      pool.run(0, n, grain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        std::lock_guard<std::mutex> lock(mutex);
        workers.insert(std::this_thread::get_id());
        parts.emplace_back(b, e);
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain << " i " << i;
      for (auto [b, e] : parts) EXPECT_TRUE(e - b >= grain || e == n) << b << ".." << e;
      if (n >= 3 * grain) EXPECT_EQ(workers.size(), 3u) << "n " << n << " grain " << grain;
    }
  }
}

TEST(SpinPoolTest, ManyShortRunsAndSleepingWorkers) {
  SpinPool pool(2);
  std::atomic<int64_t> total{0};
  for (int run = 0; run < 2000; ++run) {
    pool.run(0, 100, 1, [&](int64_t b, int64_t e) { total.fetch_add(e - b); });
    if (run % 500 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the worker sleeps
  }
  EXPECT_EQ(total.load(), 2000 * 100);
}

TEST(SpinPoolTest, AnExceptionReachesTheCaller) {
  SpinPool pool(2);
  EXPECT_THROW(pool.run(0, 10, 1, [](int64_t b, int64_t) { if (b > 0) throw std::runtime_error("worker"); }),
               std::runtime_error);
  EXPECT_THROW(pool.run(0, 10, 1, [](int64_t b, int64_t) { if (b == 0) throw std::runtime_error("caller"); }),
               std::runtime_error);
  int64_t done = 0;
  pool.run(0, 10, 100, [&](int64_t b, int64_t e) { done += e - b; });  // still works; one part only
  EXPECT_EQ(done, 10);
}

TEST(SpinPoolTest, ParallelForUsesTheInstalledPool) {
  SpinPool pool(2);
  std::set<std::thread::id> seen;
  std::mutex mutex;
  auto record = [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  };
  {
    PoolScope scope(&pool);
    EXPECT_EQ(current_pool(), &pool);
    parallel_for(0, 1000, 1, record);
  }
  EXPECT_EQ(current_pool(), nullptr);
  EXPECT_EQ(seen.size(), 2u);
}

TEST(SpinPoolTest, APartThatSplitsAgainRunsAlone) {
  SpinPool pool(2);
  PoolScope scope(&pool);
  std::atomic<int64_t> total{0};
  parallel_for(0, 100, 1, [&](int64_t b, int64_t e) {
    parallel_for(b, e, 1, [&](int64_t ib, int64_t ie) { total.fetch_add(ie - ib); });  // no deadlock
  });
  EXPECT_EQ(total.load(), 100);
}
