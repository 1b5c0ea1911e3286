#pragma once
// One thread of the process computes at a time.
//
// ATen's intra-op parallelism (OpenMP) assumes its team has the cores to itself: two threads
// that each start a parallel region on a 2-core machine wait on each other's descheduled
// workers, and both slow down several times. The serving engine's compute thread holds this
// lock for each step; every other C++ entry point that runs model compute (training steps,
// a direct forward) holds it too, so they take turns (first come, first served) instead.

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
