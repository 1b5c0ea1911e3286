#pragma once
// The engine's policy, without tensors: which waiting requests start (their KV range is
// reserved from the pool), and what each step computes — one decode token for every running
// request whose prompt is in, plus prompt chunks within the per-step prefill budget.
// Interactive requests go before background ones; within a priority, first come first served.

#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "cartridges/engine.h"
#include "engine/kv_range_allocator.h"

namespace cartridges {

struct SchedulerOptions {
  int64_t kv_tokens = 32768;
  int64_t max_running = 64;
  int64_t prefill_tokens_per_step = 512;
  int64_t max_waiting = 1024;
};

struct Scheduled {
  int64_t id = 0;
  Priority priority = Priority::kInteractive;
  int64_t prompt_tokens = 0;  // to prefill
  int64_t reserve = 0;        // KV slots held while running (prompt + output, per row)
  int64_t rows = 1;           // sequences computed for it in each step (one per cartridge of a mixture)
  int64_t arrival = 0;
  // Running state.
  int64_t kv_offset = -1;
  int64_t prefilled = 0;  // prompt tokens already in the KV pool

  bool prefill_done() const { return prefilled == prompt_tokens; }
};

// A running request's KV range moved by compaction: the slots it held from `from` on now
// start at `to` (to < from); the engine moves their contents before the step.
struct KVMove {
  int64_t id = 0, from = 0, to = 0;
};

struct StepPlan {
  std::vector<KVMove> moves;                           // applied to the pool first, in order
  std::vector<int64_t> decode;                         // running requests decoding one token
  std::vector<std::pair<int64_t, int64_t>> prefill;    // (request, prompt tokens this step)
  bool empty() const { return decode.empty() && prefill.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);

  // Adds a waiting request computed as `rows` sequences, each with the same prompt: it holds
  // `reserve` KV slots in all, counts `rows` against max_running and `rows` tokens of the
  // prefill budget per prompt token. ContextLengthError when `reserve` exceeds the whole pool
  // (it could never start); EngineBusyError when the waiting queue is full.
  void enqueue(int64_t id, Priority priority, int64_t prompt_tokens, int64_t reserve, int64_t rows = 1);
  // Starts the waiting requests that fit, in priority order (stopping at the first that does
  // not, so that a large request is not starved by smaller ones behind it), then plans a step.
  // When the head fits the pool's free slots but no free range (fragmentation), the running
  // requests' ranges are first packed to the pool's start (the plan's `moves`).
  StepPlan plan();
  // After a step: `tokens` more prompt tokens of `id` are in the pool.
  void prefilled(int64_t id, int64_t tokens);
  // A running request of several sequences computed as its sequence `row` alone from now on
  // (a routed mixture): it keeps that sequence's KV slots and gives the others' back at once,
  // so that waiting requests can start in them.
  void route(int64_t id, int64_t row);
  // Removes a waiting or running request; a running one gives its KV range back at once.
  // False when unknown.
  bool finish(int64_t id);

  const Scheduled* find(int64_t id) const;
  bool is_running(int64_t id) const;
  int64_t running() const { return static_cast<int64_t>(running_.size()); }
  int64_t running_rows() const { return running_rows_; }
  int64_t waiting() const { return static_cast<int64_t>(waiting_[0].size() + waiting_[1].size()); }
  int64_t kv_used() const { return allocator_.used(); }
  int64_t compactions() const { return compactions_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  void admit(std::vector<KVMove>& moves);
  void compact(std::vector<KVMove>& moves);

  SchedulerOptions options_;
  KVRangeAllocator allocator_;
  int64_t arrivals_ = 0;
  int64_t running_rows_ = 0;
  int64_t compactions_ = 0;
  std::deque<Scheduled> waiting_[2];    // by priority
  std::map<int64_t, Scheduled> running_;  // by id
};

}  // namespace cartridges
