#pragma once
// One thread of the process computes at a time.
//
// ATen's intra-op parallelism (OpenMP) assumes its team has the cores to itself: two threads
// that each start a parallel region on a 2-core machine wait on each other's descheduled
// workers, and both slow down several times. The model's forward functions take no lock;
// whoever calls them holds it: the serving engine's compute thread for each step, the training
// loop for each step, and the Python bindings for each compute call (a forward, logits, a
// prefix, a loss). So they take turns (first come, first served) instead.

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace cartridges {

class ComputeLock {
 public:
  // Blocks until this thread's turn.
  ComputeLock();
  ~ComputeLock();
  ComputeLock(const ComputeLock&) = delete;
  ComputeLock& operator=(const ComputeLock&) = delete;

 private:
  bool reentered_;
};

}  // namespace cartridges
