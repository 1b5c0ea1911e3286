#pragma once
// Splitting a kernel's work across threads that spin between pieces of work.
//
// A batch-1 decode step runs about 150 short parallel sections (each matrix product, each
// attention), tens of microseconds apiece. OpenMP's teams keep their threads spinning between
// sections only while the process holds no more OpenMP threads than cores: once any other
// thread has started a team (a script's main thread after one parallel torch op, a server's
// worker thread), libgomp counts more threads than cores and puts every waiting thread to
// sleep at each barrier, and a step on two cores took twice as long as on one
// (docs/experiments.md, "Why is decode on two threads slower than on one?"). The engine's
// compute thread therefore installs a SpinPool for its steps; kernels split their work with
// `parallel_for` below, which uses the calling thread's pool when it has one and
// at::parallel_for otherwise (training, the library's own forwards).

#include <ATen/Parallel.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cartridges {

class SpinPool {
 public:
  // `threads` counts the caller: threads - 1 workers are started.
  explicit SpinPool(int threads);
  ~SpinPool();
  SpinPool(const SpinPool&) = delete;
  SpinPool& operator=(const SpinPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(b, e) over [begin, end) in contiguous parts of at least `grain` (but the last), one per
  // thread; the caller takes the first part and returns when every part is done. An exception
  // of any part is rethrown here.
  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void work(int index);

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  // The current run, written before generation_ moves and read after it has.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  bool running_ = false;  // the caller's thread only
};

// Installs `pool` for the calling thread while in scope (nullptr: none).
class PoolScope {
 public:
  explicit PoolScope(SpinPool* pool);
  ~PoolScope();
  void reset(SpinPool* pool);  // installs another
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  SpinPool* previous_;
};

SpinPool* current_pool();

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (SpinPool* pool = current_pool()) {
    pool->run(begin, end, grain, std::function<void(int64_t, int64_t)>(std::cref(fn)));
  } else {
    at::parallel_for(begin, end, grain, fn);
  }
}

}  // namespace cartridges
