// The forward on a tiny random model: KV cache, ragged batches and prefixes agree with the
// plain full-sequence forward.
#include <gtest/gtest.h>

#include "cartridges/engine.h"
#include "cartridges/kv_pool.h"
#include "cartridges/model.h"
#include "tiny_model.h"

using namespace cartridges;
using cartridges::test_models::random_weights;
using cartridges::test_models::tiny_config;

namespace {

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(0);
    config = tiny_config();
    model = std::make_unique<LlamaModel>(config, random_weights(config), at::kCPU, at::kFloat);
  }
  at::Tensor full(const at::Tensor& tokens) const { return model->forward({tokens.view({1, -1}), {}, {}}, nullptr)[0]; }

  LlamaConfig config;
  std::unique_ptr<LlamaModel> model;
};

}  // namespace

TEST_F(ModelTest, CachedDecodeMatchesFullForward) {
  auto tokens = at::randint(config.vocab_size, {12}, at::kLong);
  auto expected = full(tokens);
  auto cache = model->new_cache(1, 12);
  auto got = model->forward({tokens.narrow(0, 0, 8).view({1, 8}), {}, {}}, &cache)[0];
  EXPECT_TRUE(at::allclose(got, expected.narrow(0, 0, 8), 1e-5, 1e-5));
  for (int64_t i = 8; i < 12; ++i) {
    auto step = model->forward({tokens.narrow(0, i, 1).view({1, 1}), {}, {}}, &cache)[0][0];
    EXPECT_TRUE(at::allclose(step, expected[i], 1e-4, 1e-5)) << "step " << i;
  }
  EXPECT_EQ(cache.lengths[0], 12);
}

TEST_F(ModelTest, RaggedBatchMatchesSingleRows) {
  std::vector<at::Tensor> prompts = {at::randint(config.vocab_size, {7}, at::kLong),
                                     at::randint(config.vocab_size, {3}, at::kLong),
                                     at::randint(config.vocab_size, {5}, at::kLong)};
  auto tokens = at::zeros({3, 7}, at::kLong);
  std::vector<int64_t> lens;
  for (int64_t b = 0; b < 3; ++b) {
    tokens[b].narrow(0, 0, prompts[b].size(0)).copy_(prompts[b]);
    lens.push_back(prompts[b].size(0));
  }
  auto cache = model->new_cache(3, 9);
  auto last = model->forward_last({tokens, lens, {}}, &cache);
  // One decode step with different cached lengths per row.
  auto next = at::randint(config.vocab_size, {3, 1}, at::kLong);
  auto step = model->forward_last({next, {}, {}}, &cache);
  for (int64_t b = 0; b < 3; ++b) {
    auto alone = full(prompts[b]);
    EXPECT_TRUE(at::allclose(last[b], alone[lens[b] - 1], 1e-4, 1e-5)) << "row " << b;
    auto extended = full(at::cat({prompts[b], next[b]}));
    EXPECT_TRUE(at::allclose(step[b], extended[lens[b]], 1e-4, 1e-5)) << "row " << b;
  }
}

TEST_F(ModelTest, PrefixFromTokensEqualsTokensInContext) {
  auto doc = at::randint(config.vocab_size, {10}, at::kLong);
  auto other = at::randint(config.vocab_size, {6}, at::kLong);
  auto prompt = at::randint(config.vocab_size, {5}, at::kLong);
  PrefixPtr p1 = std::make_shared<KVPrefix>(model->prefix_from_tokens(doc));
  EXPECT_EQ(p1->num_tokens(), 10);
  auto with_prefix = model->forward({prompt.view({1, 5}), {}, {{p1}}}, nullptr)[0];
  auto in_context = full(at::cat({doc, prompt})).narrow(0, 10, 5);
  EXPECT_TRUE(at::allclose(with_prefix, in_context, 1e-4, 1e-5));

  // A second prefix built after the first (positions 10..15) composes by concatenation.
  auto cache = model->new_cache(1, 16);
  model->forward({at::cat({doc, other}).view({1, 16}), {}, {}}, &cache);
  auto p2 = std::make_shared<KVPrefix>();
  for (int64_t l = 0; l < config.num_layers; ++l) {
    p2->keys.push_back(cache.keys[l][0].narrow(1, 10, 6).clone());
    p2->values.push_back(cache.values[l][0].narrow(1, 10, 6).clone());
  }
  auto composed = model->forward({prompt.view({1, 5}), {}, {{p1, p2}}}, nullptr)[0];
  auto in_context2 = full(at::cat({doc, other, prompt})).narrow(0, 16, 5);
  EXPECT_TRUE(at::allclose(composed, in_context2, 1e-4, 1e-5));
}

TEST_F(ModelTest, BadInputsAreRefused) {
  auto bad = random_weights(config);
  bad.erase("model.layers.1.mlp.up_proj.weight");
  EXPECT_THROW(LlamaModel(config, bad, at::kCPU, at::kFloat), c10::Error);
}

// A sequence with all_logits returns a row at each new token from logits_from on (a mixture
// scores the prompt past its system prompt only); a logits_from past its tokens is refused.
TEST_F(ModelTest, PackedStepReturnsEveryRowFromLogitsFrom) {
  auto a = at::randint(config.vocab_size, {7}, at::kLong), b = at::randint(config.vocab_size, {3}, at::kLong);
  KVPool pool(config, 32, model->options());
  PackedBatch batch;
  batch.tokens = at::cat({a, b});
  batch.sequences = {{0, 0, 7, {}, true, true, 3}, {16, 0, 3, {}, true}};
  auto logits = model->forward_packed(batch, pool);
  ASSERT_EQ(logits.size(0), 5);  // rows 3..6 of a, then b's last
  EXPECT_TRUE(at::allclose(logits.narrow(0, 0, 4), full(a).narrow(0, 3, 4), 1e-4, 1e-5));
  EXPECT_TRUE(at::allclose(logits[4], full(b)[2], 1e-4, 1e-5));
  batch.sequences[0].logits_from = 8;
  EXPECT_THROW(model->forward_packed(batch, pool), c10::Error);
}

TEST_F(ModelTest, PackedStepMatchesFullForward) {
  // Three sequences in one packed step: a prefill chunk after earlier tokens, a decode token,
  // and a whole prompt behind a prefix; each row's logits equal the plain forward's.
  auto doc = at::randint(config.vocab_size, {6}, at::kLong);
  auto prefix = std::make_shared<const KVPrefix>(model->prefix_from_tokens(doc));
  auto a = at::randint(config.vocab_size, {9}, at::kLong), b = at::randint(config.vocab_size, {5}, at::kLong),
       c = at::randint(config.vocab_size, {4}, at::kLong);
  KVPool pool(config, 64, model->options());
  // Step 1: a's first 5 tokens and b's first 4.
  PackedBatch first;
  first.tokens = at::cat({a.narrow(0, 0, 5), b.narrow(0, 0, 4)});
  first.sequences = {{0, 0, 5, {}, false}, {20, 0, 4, {}, true}};
  model->forward_packed(first, pool);
  // Step 2: the rest of a (chunk), b's 5th token (decode), all of c behind the prefix.
  PackedBatch second;
  second.tokens = at::cat({a.narrow(0, 5, 4), b.narrow(0, 4, 1), c});
  second.sequences = {{0, 5, 4, {}, true}, {20, 4, 1, {}, true}, {40, 0, 4, {prefix}, true}};
  auto logits = model->forward_packed(second, pool);
  ASSERT_EQ(logits.size(0), 3);
  EXPECT_TRUE(at::allclose(logits[0], full(a)[8], 1e-4, 1e-5));
  EXPECT_TRUE(at::allclose(logits[1], full(b)[4], 1e-4, 1e-5));
  EXPECT_TRUE(at::allclose(logits[2], full(at::cat({doc, c}))[9], 1e-4, 1e-5));
}
