#include "cartridges/compute.h"

#include <thread>

namespace cartridges {

namespace {

// A ticket lock: waiters are served in arrival order, so a thread that releases and takes the
// lock again in a loop (the engine, a training loop) cannot starve the others.
struct Tickets {
  std::mutex mutex;
  std::condition_variable turn;
  uint64_t next = 0, serving = 0;
  std::thread::id owner;
};

Tickets& tickets() {
  static Tickets t;
  return t;
}

}  // namespace

ComputeLock::ComputeLock() {
  auto& t = tickets();
  std::unique_lock<std::mutex> lock(t.mutex);
  // A compute call made while holding the lock (a forward inside a training step) goes on.
  reentered_ = t.owner == std::this_thread::get_id();
  if (reentered_) return;
  const uint64_t mine = t.next++;
  t.turn.wait(lock, [&] { return t.serving == mine; });
  t.owner = std::this_thread::get_id();
}

ComputeLock::~ComputeLock() {
  if (reentered_) return;
  auto& t = tickets();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    t.owner = std::thread::id();
    ++t.serving;
  }
  t.turn.notify_all();
}

}  // namespace cartridges
