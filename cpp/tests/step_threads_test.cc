// The rule that gives ATen one thread in steps that decode or prefill little.

#include <gtest/gtest.h>

#include <memory>

#include "engine/step_threads.h"

namespace cartridges {
namespace {

PrefixPtr prefix_of(int64_t tokens) {
  auto prefix = std::make_shared<KVPrefix>();
  prefix->keys.push_back(at::zeros({1, tokens, 4}));
  prefix->values.push_back(at::zeros({1, tokens, 4}));
  return prefix;
}

PackedSequence sequence(int64_t past, int64_t num_new, PrefixList prefixes = {}) {
  PackedSequence s;
  s.past = past;
  s.num_new = num_new;
  s.prefixes = std::move(prefixes);
  return s;
}

int threads_for(std::vector<PackedSequence> sequences, bool quantized = true) {
  PackedBatch batch;
  batch.sequences = std::move(sequences);
  return aten_threads_for(batch, 2, quantized);
}

TEST(StepThreads, DecodeOnlyStepsAndShortPromptsTakeOneThread) {
  EXPECT_EQ(threads_for({sequence(500, 1), sequence(30, 1, {prefix_of(4096)})}), 1);
  EXPECT_EQ(threads_for({sequence(0, 42)}), 1);
  EXPECT_EQ(threads_for({sequence(0, 18, {prefix_of(24)}), sequence(100, 1)}), 1);  // a cached chat opening
  EXPECT_EQ(threads_for({sequence(0, 42, {prefix_of(256)})}), 1);
}

TEST(StepThreads, LongPromptsLongContextsAndLargeCartridgesTakeEveryThread) {
  EXPECT_EQ(threads_for({sequence(0, 256)}), 2);                     // over the token count
  EXPECT_EQ(threads_for({sequence(4000, 64)}), 2);                   // a short chunk reading many keys
  EXPECT_EQ(threads_for({sequence(0, 42, {prefix_of(1024)})}), 2);   // a large cartridge's products
  EXPECT_EQ(threads_for({sequence(0, 40), sequence(0, 40), sequence(0, 60)}), 2);  // small prompts adding up
  EXPECT_EQ(threads_for({sequence(0, 16)}, /*quantized=*/false), 2);  // a float model's products are ATen's
}

TEST(StepThreads, PairsCountACartridgesKeysThreeTimes) {
  PackedBatch batch;
  batch.sequences = {sequence(10, 20, {prefix_of(100), prefix_of(50)}), sequence(7, 1, {prefix_of(4096)})};
  EXPECT_EQ(prefill_attention_pairs(batch), 20 * (10 + 20 + 3 * 150));
}

}  // namespace
}  // namespace cartridges
