#include "model/spin_pool.h"

#include <algorithm>
#include <chrono>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cartridges {

namespace {

thread_local SpinPool* installed = nullptr;

// How long a worker spins for the next section before it sleeps: longer than the gaps between
// the sections of a step (ATen's small operators, microseconds), shorter than the time the
// server's event loop needs between steps to send the tokens: with 500 µs the spinning worker
// took that core from it, and one HTTP client got 0.85-0.91x the engine's tokens/s, with 100 µs
// 0.98x (benchmarks/bench_http.py, 2 cores).
constexpr auto kSpin = std::chrono::microseconds(100);

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

SpinPool::SpinPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
}

SpinPool::~SpinPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void SpinPool::run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t parts = std::min<int64_t>(threads(), (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  if (parts <= 1 || workers_.empty() || running_) {  // running_: a part that splits again runs alone
    fn(begin, end);
    return;
  }
  running_ = true;
  fn_ = &fn;
  begin_ = begin;
  end_ = end;
  chunk_ = (n + parts - 1) / parts;
  error_ = nullptr;
  pending_.store(static_cast<int>(workers_.size()));
  generation_.fetch_add(1);  // seq_cst, against a worker going to sleep (see work)
  if (sleeping_.load() > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_all();
  }
  try {
    fn(begin, std::min(begin + chunk_, end));
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!error_) error_ = std::current_exception();
  }
  while (pending_.load(std::memory_order_acquire) != 0) pause();
  running_ = false;
  if (error_) std::rethrow_exception(error_);
}

void SpinPool::work(int index) {
  uint64_t seen = 0;
  for (;;) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && !stopping_.load(std::memory_order_relaxed)) {
      pause();
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);  // seq_cst: run() either sees it and wakes us, or we see its generation
        wake_.wait(lock, [&] { return generation_.load() != seen || stopping_.load(); });
        sleeping_.fetch_sub(1);
      }
    }
    if (stopping_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    const int64_t b = begin_ + index * chunk_, e = std::min(b + chunk_, end_);
    if (b < e) {
      try {
        (*fn_)(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

PoolScope::PoolScope(SpinPool* pool) : previous_(installed) { installed = pool; }
PoolScope::~PoolScope() { installed = previous_; }
void PoolScope::reset(SpinPool* pool) { installed = pool; }

SpinPool* current_pool() { return installed; }

}  // namespace cartridges
