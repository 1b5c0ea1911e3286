#pragma once
// How many threads ATen's operators get in a serving step. The engine's own kernels (the
// quantized products, the decode attention, norms, RoPE) always split their work on its
// spinning pool (model/spin_pool.h); what is left to ATen runs on OpenMP, whose threads sleep
// between parallel sections in a server's process, so that every section that splits pays for
// waking the team. A prefill's attention needs the cores on long prompts (ATen's fused
// attention over a chunk's own keys, the matrix products over a cartridge's), but a short chunk
// is about twenty small operators a layer whose wake-ups cost more than a second thread saves:
// on 2 cores a chat prompt of 42 tokens behind a cached 24-token opening took 36-37 ms to its
// first token on two ATen threads and 24-25 ms on one, while a 512-token prompt and a short one
// behind a 1,024-token cartridge are faster on two (docs/experiments.md, "Should a short
// prefill's ATen operators run on one thread?").

#include <cstdint>

#include "cartridges/kv_pool.h"

namespace cartridges {

// A step's prefill is small when its chunks hold at most this many tokens...
constexpr int64_t kSmallPrefillTokens = 128;
// ...and at most this many (query, key) pairs of attention: each chunk's tokens times the keys
// they read, a cartridge's counted three times (its scores are materialized matrix products,
// where the own keys go through the fused kernel).
constexpr int64_t kSmallPrefillPairs = 40000;
constexpr int64_t kPrefixPairWeight = 3;

// The (query, key) pairs of attention in `batch`'s prefill chunks, weighted as above.
inline int64_t prefill_attention_pairs(const PackedBatch& batch) {
  int64_t pairs = 0;
  for (const auto& s : batch.sequences) {
    if (s.num_new == 1) continue;
    int64_t prefix = 0;
    for (const auto& p : s.prefixes) prefix += p->num_tokens();
    pairs += s.num_new * (s.past + s.num_new + kPrefixPairWeight * prefix);
  }
  return pairs;
}

// ATen's thread count for a step of `batch` in an engine of `threads` threads: one where every
// matrix product is the engine's own (`quantized_products`) and the step decodes or prefills
// little; otherwise all of them (a float model's products are ATen's own).
inline int aten_threads_for(const PackedBatch& batch, int threads, bool quantized_products) {
  if (!quantized_products) return threads;
  int64_t prefill_tokens = 0;
  for (const auto& s : batch.sequences) {
    if (s.num_new > 1) prefill_tokens += s.num_new;
  }
  const bool small = prefill_tokens <= kSmallPrefillTokens && prefill_attention_pairs(batch) <= kSmallPrefillPairs;
  return small ? 1 : threads;
}

}  // namespace cartridges
