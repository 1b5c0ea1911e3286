// The engine's policy without a model: admission under the KV budget, the per-step prefill
// budget, priorities, the bounded queue, cancellation; the KV range allocator; the
// cartridge cache's eviction rules.
#include <gtest/gtest.h>

#include "cartridges/engine.h"
#include "engine/kv_range_allocator.h"
#include "engine/scheduler.h"

using namespace cartridges;

namespace {

SchedulerOptions small(int64_t kv = 100, int64_t running = 8, int64_t prefill = 16, int64_t waiting = 4) {
  return {kv, running, prefill, waiting};
}

int64_t planned_prefill(const StepPlan& p) {
  int64_t n = 0;
  for (auto [id, chunk] : p.prefill) n += chunk;
  return n;
}

PrefixPtr prefix_of_bytes(int64_t floats_per_tensor) {
  auto p = std::make_shared<KVPrefix>();
  p->keys.push_back(at::zeros({1, floats_per_tensor, 1}));
  p->values.push_back(at::zeros({1, floats_per_tensor, 1}));
  return p;  // 8 * floats_per_tensor bytes
}

}  // namespace

TEST(KVRangeAllocator, FirstFitAndMerging) {
  KVRangeAllocator a(10);
  EXPECT_EQ(a.allocate(4), 0);
  EXPECT_EQ(a.allocate(4), 4);
  EXPECT_FALSE(a.allocate(3).has_value());
  a.release(0, 4);
  EXPECT_EQ(a.allocate(3), 0);  // first fit
  a.release(0, 3);
  a.release(4, 4);  // merges with [0, 4) and [8, 10)
  EXPECT_EQ(a.used(), 0);
  EXPECT_EQ(a.largest_free(), 10);
  EXPECT_EQ(a.allocate(10), 0);
}

TEST(Scheduler, AdmitsUnderTheKVBudgetAndQueuesTheRest) {
  Scheduler s(small(/*kv=*/100));
  s.enqueue(1, Priority::kInteractive, 10, 60);
  s.enqueue(2, Priority::kInteractive, 10, 50);  // 60 + 50 > 100: waits
  s.enqueue(3, Priority::kInteractive, 5, 30);   // would fit, but does not jump ahead of 2
  s.plan();
  EXPECT_TRUE(s.is_running(1));
  EXPECT_FALSE(s.is_running(2));
  EXPECT_FALSE(s.is_running(3));
  EXPECT_EQ(s.kv_used(), 60);
  EXPECT_TRUE(s.finish(1));  // its range comes back at once
  s.plan();
  EXPECT_TRUE(s.is_running(2) && s.is_running(3));
  EXPECT_EQ(s.kv_used(), 80);
}

TEST(Scheduler, PacksTheRunningRangesWhenTheFreeSlotsSufficeButNoFreeRangeDoes) {
  Scheduler s(small(/*kv=*/100));
  for (int64_t id = 1; id <= 3; ++id) s.enqueue(id, Priority::kInteractive, 5, 30);
  EXPECT_TRUE(s.plan().moves.empty());  // 1 at 0, 2 at 30, 3 at 60
  EXPECT_TRUE(s.finish(2));             // free: [30, 60) and [90, 100)
  s.enqueue(4, Priority::kInteractive, 5, 40);
  auto plan = s.plan();
  ASSERT_TRUE(s.is_running(4));
  EXPECT_EQ(s.compactions(), 1);
  ASSERT_EQ(plan.moves.size(), 1u);  // 1 stays where it is
  EXPECT_EQ(plan.moves[0].id, 3);
  EXPECT_EQ(plan.moves[0].from, 60);
  EXPECT_EQ(plan.moves[0].to, 30);
  EXPECT_EQ(s.find(3)->kv_offset, 30);
  EXPECT_EQ(s.find(4)->kv_offset, 60);
  EXPECT_EQ(s.kv_used(), 100);
  // More than the free total: it waits, and nothing moves.
  EXPECT_TRUE(s.finish(1));
  s.enqueue(5, Priority::kInteractive, 5, 31);
  EXPECT_TRUE(s.plan().moves.empty());
  EXPECT_FALSE(s.is_running(5));
  EXPECT_EQ(s.compactions(), 1);
}

TEST(Scheduler, NeverMoreThanMaxRunning) {
  Scheduler s(small(100, /*running=*/2));
  for (int64_t id = 0; id < 3; ++id) s.enqueue(id, Priority::kInteractive, 1, 2);
  s.plan();
  EXPECT_EQ(s.running(), 2);
  EXPECT_EQ(s.waiting(), 1);
}

TEST(Scheduler, PrefillIsChunkedWithinTheStepBudget) {
  Scheduler s(small(100, 8, /*prefill=*/16));
  s.enqueue(1, Priority::kInteractive, 40, 50);
  s.enqueue(2, Priority::kInteractive, 10, 20);
  auto p = s.plan();
  ASSERT_EQ(p.prefill.size(), 1u);  // the first takes the whole budget
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{1}, int64_t{16}));
  s.prefilled(1, 16);
  p = s.plan();
  s.prefilled(1, 16);
  p = s.plan();  // 8 left of request 1, then 8 of request 2
  ASSERT_EQ(p.prefill.size(), 2u);
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{1}, int64_t{8}));
  EXPECT_EQ(p.prefill[1], std::make_pair(int64_t{2}, int64_t{8}));
  EXPECT_EQ(planned_prefill(p), 16);
  s.prefilled(1, 8);
  s.prefilled(2, 8);
  p = s.plan();  // request 1 decodes beside the rest of request 2's prompt
  EXPECT_EQ(p.decode, std::vector<int64_t>{1});
  EXPECT_EQ(p.prefill.size(), 1u);
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{2}, int64_t{2}));
}

// No chunk of a longer prompt is a single token (it would take the decode kernel, whose
// arithmetic differs from the prefill's), unless the budget allows no other cut.
TEST(Scheduler, APromptIsNeverCutIntoAOneTokenChunk) {
  Scheduler s(small(200, 8, /*prefill=*/16));
  s.enqueue(1, Priority::kInteractive, 17, 20);  // 16 + 1 would leave one token: 15 + 2
  s.enqueue(2, Priority::kInteractive, 1, 5);    // a one-token prompt is one chunk
  s.enqueue(3, Priority::kInteractive, 15, 20);
  auto p = s.plan();
  ASSERT_EQ(p.prefill.size(), 2u);
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{1}, int64_t{15}));
  EXPECT_EQ(p.prefill[1], std::make_pair(int64_t{2}, int64_t{1}));
  s.prefilled(1, 15);
  s.prefilled(2, 1);
  p = s.plan();  // 2 of request 1; 14 of request 3 would leave one token: 13
  ASSERT_EQ(p.prefill.size(), 2u);
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{1}, int64_t{2}));
  EXPECT_EQ(p.prefill[1], std::make_pair(int64_t{3}, int64_t{13}));
  Scheduler tight(small(200, 8, /*prefill=*/2));  // a budget of 2 cuts 3 tokens into 2 + 1
  tight.enqueue(1, Priority::kInteractive, 3, 4);
  p = tight.plan();
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{1}, int64_t{2}));
  tight.prefilled(1, 2);
  EXPECT_EQ(tight.plan().prefill[0], std::make_pair(int64_t{1}, int64_t{1}));
}

TEST(Scheduler, EverySequenceOfARequestCountsAgainstRunningAndPrefill) {
  Scheduler s(small(/*kv=*/100, /*running=*/3, /*prefill=*/16));
  s.enqueue(1, Priority::kInteractive, 20, 50, /*rows=*/2);  // a mixture of two cartridges
  s.enqueue(2, Priority::kInteractive, 4, 10, /*rows=*/2);   // 2 + 2 rows > 3: waits
  auto p = s.plan();
  EXPECT_TRUE(s.is_running(1));
  EXPECT_FALSE(s.is_running(2));
  EXPECT_EQ(s.running_rows(), 2);
  EXPECT_EQ(s.kv_used(), 50);
  ASSERT_EQ(p.prefill.size(), 1u);
  EXPECT_EQ(p.prefill[0], std::make_pair(int64_t{1}, int64_t{8}));  // 8 tokens x 2 sequences = 16
  EXPECT_THROW(s.enqueue(3, Priority::kInteractive, 4, 40, /*rows=*/4), c10::Error);  // > max_running
  EXPECT_TRUE(s.finish(1));
  s.plan();
  EXPECT_TRUE(s.is_running(2));
  EXPECT_EQ(s.running_rows(), 2);
}

TEST(Scheduler, ARoutedRequestKeepsItsChosenSequenceAndGivesTheOthersBack) {
  for (int64_t row : {0, 1, 2}) {
    Scheduler s(small(/*kv=*/100, /*running=*/8, /*prefill=*/64));
    s.enqueue(1, Priority::kInteractive, 10, 90, /*rows=*/3);  // 30 slots a sequence, in [0, 90)
    s.enqueue(2, Priority::kInteractive, 10, 60);              // waits: 10 slots free
    s.plan();
    s.prefilled(1, 10);
    ASSERT_FALSE(s.is_running(2));
    s.route(1, row);
    EXPECT_EQ(s.find(1)->kv_offset, 30 * row);  // its sequence's slots, where they were: nothing moves
    EXPECT_EQ(s.find(1)->reserve, 30);
    EXPECT_EQ(s.find(1)->rows, 1);
    EXPECT_EQ(s.running_rows(), 1);
    EXPECT_EQ(s.kv_used(), 30);
    auto p = s.plan();  // the freed slots take the waiting request (packed, when row 1 splits them)
    EXPECT_TRUE(s.is_running(2));
    EXPECT_EQ(s.kv_used(), 90);
    EXPECT_EQ(p.moves.size(), row == 1 ? 1u : 0u);
    EXPECT_TRUE(s.finish(1) && s.finish(2));
    EXPECT_EQ(s.kv_used(), 0);  // each range given back once, whole
    EXPECT_EQ(s.plan().moves.size(), 0u);
  }
}

TEST(Scheduler, InteractiveGoesBeforeBackground) {
  Scheduler s(small(/*kv=*/20, 8, /*prefill=*/4));
  s.enqueue(1, Priority::kBackground, 4, 10);
  s.enqueue(2, Priority::kBackground, 4, 10);
  s.enqueue(3, Priority::kInteractive, 4, 10);  // arrives last, starts first
  auto p = s.plan();
  EXPECT_TRUE(s.is_running(3));
  EXPECT_TRUE(s.is_running(1));
  EXPECT_FALSE(s.is_running(2));
  ASSERT_EQ(p.prefill.size(), 1u);
  EXPECT_EQ(p.prefill[0].first, 3);  // and its prompt is prefilled first
}

TEST(Scheduler, BoundedQueueAndRequestsThatCanNeverFit) {
  Scheduler s(small(/*kv=*/100, 8, 16, /*waiting=*/2));
  EXPECT_THROW(s.enqueue(9, Priority::kInteractive, 10, 101), ContextLengthError);
  s.enqueue(1, Priority::kInteractive, 1, 1);
  s.enqueue(2, Priority::kInteractive, 1, 1);
  EXPECT_THROW(s.enqueue(3, Priority::kInteractive, 1, 1), EngineBusyError);
  s.plan();  // both start; the queue has room again
  s.enqueue(3, Priority::kInteractive, 1, 1);
}

TEST(Scheduler, CancelQueuedAndRunning) {
  Scheduler s(small(/*kv=*/10));
  s.enqueue(1, Priority::kInteractive, 2, 10);
  s.enqueue(2, Priority::kInteractive, 2, 10);
  s.plan();
  EXPECT_TRUE(s.finish(2));  // queued: gone without ever starting
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_TRUE(s.finish(1));  // running: its KV is free
  EXPECT_EQ(s.kv_used(), 0);
  EXPECT_FALSE(s.finish(1));
  EXPECT_TRUE(s.plan().empty());
}

TEST(CartridgeCache, EvictsLeastRecentlyUsedIdleOnly) {
  CartridgeCache cache(/*budget=*/3 * 800);
  cache.put("a", prefix_of_bytes(100));
  cache.put("b", prefix_of_bytes(100));
  cache.put("c", prefix_of_bytes(100));
  PrefixPtr held = cache.get("a");  // a request holds "a"; "b" is now least recently used
  cache.put("d", prefix_of_bytes(100));
  EXPECT_TRUE(cache.contains("a"));
  EXPECT_FALSE(cache.contains("b"));
  auto s = cache.stats();
  EXPECT_EQ(s.evictions, 1);
  EXPECT_EQ(s.loads, 4);
  EXPECT_EQ(s.bytes, 3 * 800);
  EXPECT_LE(s.bytes, s.budget_bytes);
  // Only "a" is in use: loading 2 more entries' worth evicts c and d, never a.
  cache.put("big", prefix_of_bytes(200));
  EXPECT_TRUE(cache.contains("a"));
  EXPECT_EQ(cache.stats().bytes, 3 * 800);
  // Too big even after evicting every idle cartridge: refused, and nothing is evicted.
  EXPECT_THROW(cache.put("huge", prefix_of_bytes(250)), CacheFullError);
  EXPECT_TRUE(cache.contains("big"));
  EXPECT_EQ(held.use_count(), 2);  // still alive for its holder
  EXPECT_EQ(cache.get("zzz"), nullptr);
  EXPECT_EQ(cache.stats().misses, 1);
}
