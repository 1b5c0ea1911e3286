#include "engine/scheduler.h"

#include <algorithm>
#include <string>

namespace cartridges {

Scheduler::Scheduler(SchedulerOptions options) : options_(options), allocator_(options.kv_tokens) {
  TORCH_CHECK(options.max_running > 0, "max_running must be positive");
  TORCH_CHECK(options.prefill_tokens_per_step > 0, "prefill_tokens_per_step must be positive");
  TORCH_CHECK(options.max_waiting >= 0, "max_waiting must not be negative");
}

void Scheduler::enqueue(int64_t id, Priority priority, int64_t prompt_tokens, int64_t reserve, int64_t rows) {
  TORCH_CHECK(prompt_tokens > 0 && rows > 0 && reserve >= prompt_tokens * rows, "a request needs a prompt and room for it");
  TORCH_CHECK(rows <= options_.max_running && rows <= options_.prefill_tokens_per_step, "a request of ", rows,
              " sequences exceeds the engine's max_running (", options_.max_running,
              ") or prefill_tokens_per_step (", options_.prefill_tokens_per_step, ")");
  if (reserve > options_.kv_tokens) {
    const std::string what = rows > 1 ? "(prompt + max tokens, for each of its " + std::to_string(rows) +
                                            " sequences: one per cartridge of a mixture)"
                                      : "(prompt + max tokens)";
    throw ContextLengthError("the request needs " + std::to_string(reserve) + " KV tokens " + what +
                             ", more than the engine's whole KV pool of " + std::to_string(options_.kv_tokens) +
                             " tokens");
  }
  if (waiting() >= options_.max_waiting) {
    throw EngineBusyError("the engine is busy: " + std::to_string(waiting()) +
                          " requests are already waiting; try again later");
  }
  Scheduled s;
  s.id = id;
  s.priority = priority;
  s.prompt_tokens = prompt_tokens;
  s.reserve = reserve;
  s.rows = rows;
  s.arrival = arrivals_++;
  waiting_[static_cast<int>(priority)].push_back(s);
}

void Scheduler::admit(std::vector<KVMove>& moves) {
  for (auto& queue : waiting_) {
    while (!queue.empty()) {
      if (running_rows_ + queue.front().rows > options_.max_running) return;
      const int64_t reserve = queue.front().reserve;
      auto offset = allocator_.allocate(reserve);
      if (!offset && allocator_.capacity() - allocator_.used() >= reserve) {
        compact(moves);  // the free slots suffice, split into ranges: make them one
        offset = allocator_.allocate(reserve);
      }
      if (!offset) return;  // the head waits for room; nothing jumps ahead of it
      Scheduled s = queue.front();
      queue.pop_front();
      s.kv_offset = *offset;
      running_rows_ += s.rows;
      running_.emplace(s.id, s);
    }
  }
}

void Scheduler::compact(std::vector<KVMove>& moves) {
  std::vector<Scheduled*> by_offset;
  for (auto& [id, s] : running_) by_offset.push_back(&s);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const Scheduled* a, const Scheduled* b) { return a->kv_offset < b->kv_offset; });
  // Slid toward the start in their order, each range lands at or before where it was and past
  // the ranges moved before it: moving them in this order never overwrites a range still to move.
  allocator_ = KVRangeAllocator(options_.kv_tokens);
  for (Scheduled* s : by_offset) {
    const int64_t to = *allocator_.allocate(s->reserve);
    if (to != s->kv_offset) moves.push_back({s->id, s->kv_offset, to});
    s->kv_offset = to;
  }
  ++compactions_;
}

StepPlan Scheduler::plan() {
  StepPlan plan;
  admit(plan.moves);
  std::vector<const Scheduled*> prefilling;
  for (const auto& [id, s] : running_) {
    if (s.prefill_done()) {
      plan.decode.push_back(id);
    } else {
      prefilling.push_back(&s);
    }
  }
  std::sort(prefilling.begin(), prefilling.end(), [](const Scheduled* a, const Scheduled* b) {
    return a->priority != b->priority ? a->priority < b->priority : a->arrival < b->arrival;
  });
  int64_t budget = options_.prefill_tokens_per_step;
  for (const Scheduled* s : prefilling) {
    const int64_t left = s->prompt_tokens - s->prefilled;
    int64_t chunk = std::min(budget / s->rows, left);
    // A chunk of one token would take the decode kernel, whose arithmetic differs from the
    // prefill's, so that the prompt's log-probs would depend on where it was cut: a prompt of
    // more than one token is cut into chunks of at least two, wherever the budget allows it.
    if (left > 1 && options_.prefill_tokens_per_step / s->rows >= 3) {
      if (left - chunk == 1) --chunk;
      if (chunk == 1) chunk = 0;
    }
    if (chunk == 0) break;
    plan.prefill.emplace_back(s->id, chunk);
    budget -= chunk * s->rows;
  }
  return plan;
}

void Scheduler::prefilled(int64_t id, int64_t tokens) {
  auto it = running_.find(id);
  TORCH_INTERNAL_ASSERT(it != running_.end() && it->second.prefilled + tokens <= it->second.prompt_tokens);
  it->second.prefilled += tokens;
}

void Scheduler::route(int64_t id, int64_t row) {
  auto it = running_.find(id);
  TORCH_INTERNAL_ASSERT(it != running_.end() && row >= 0 && row < it->second.rows &&
                        it->second.reserve % it->second.rows == 0);
  Scheduled& s = it->second;
  const int64_t per_row = s.reserve / s.rows, kept = s.kv_offset + row * per_row, end = s.kv_offset + s.reserve;
  if (kept > s.kv_offset) allocator_.release(s.kv_offset, kept - s.kv_offset);
  if (end > kept + per_row) allocator_.release(kept + per_row, end - kept - per_row);
  running_rows_ -= s.rows - 1;
  s.rows = 1;
  s.kv_offset = kept;
  s.reserve = per_row;
}

bool Scheduler::finish(int64_t id) {
  if (auto it = running_.find(id); it != running_.end()) {
    allocator_.release(it->second.kv_offset, it->second.reserve);
    running_rows_ -= it->second.rows;
    running_.erase(it);
    return true;
  }
  for (auto& queue : waiting_) {
    auto it = std::find_if(queue.begin(), queue.end(), [&](const Scheduled& s) { return s.id == id; });
    if (it != queue.end()) {
      queue.erase(it);
      return true;
    }
  }
  return false;
}

const Scheduled* Scheduler::find(int64_t id) const {
  if (auto it = running_.find(id); it != running_.end()) return &it->second;
  for (const auto& queue : waiting_) {
    for (const auto& s : queue) {
      if (s.id == id) return &s;
    }
  }
  return nullptr;
}

bool Scheduler::is_running(int64_t id) const { return running_.count(id) > 0; }

}  // namespace cartridges
