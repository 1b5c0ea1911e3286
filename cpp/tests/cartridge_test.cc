// The cartridge training core on a tiny random model: prefix split/join, Adam's first step,
// checkpoint round trip, resume = uninterrupted run, cancellation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "cartridges/cartridge.h"
#include "cartridges/model.h"
#include "tiny_model.h"

using namespace cartridges;
using cartridges::test_models::random_weights;
using cartridges::test_models::tiny_config;

namespace {

// Next-token data (K = 1, log-prob 0) on random rows of length 10, every position a target.
TrainingData next_token_data(int64_t n, int64_t vocab) {
  auto tokens = at::randint(vocab, {n, 10}, at::kLong);
  auto mask = at::zeros({n, 10}, at::kBool);
  mask.narrow(1, 0, 9).fill_(true);
  auto ids = tokens.narrow(1, 1, 9).reshape({-1, 1}).contiguous();
  return {tokens, at::full({n}, 10, at::kLong), mask, ids, at::zeros({ids.size(0), 1}, at::kFloat)};
}

class CartridgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(0);
    config = tiny_config();
    model = std::make_unique<LlamaModel>(config, random_weights(config), at::kCPU, at::kFloat);
    prefix = model->prefix_from_tokens(at::arange(1, 7, at::kLong));
    data = next_token_data(6, config.vocab_size);
  }
  std::vector<at::Tensor> trained(const CartridgeParams& p) const {
    std::vector<at::Tensor> out;
    for (const auto& t : p.parameters()) out.push_back(t.detach().clone());
    return out;
  }

  LlamaConfig config;
  std::unique_ptr<LlamaModel> model;
  KVPrefix prefix;
  TrainingData data;
};

}  // namespace

TEST_F(CartridgeTest, SplitAndJoinAreExact) {
  auto params = CartridgeParams::from_prefix(prefix, 1);
  EXPECT_EQ(params.num_tokens(), 6);
  EXPECT_EQ(params.num_frozen(), 1);
  EXPECT_TRUE(params.trainable_keys[0].requires_grad());
  EXPECT_FALSE(params.frozen_keys[0].requires_grad());
  auto joined = params.to_prefix(at::kFloat, at::kCPU, /*detach=*/true);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    EXPECT_TRUE(at::equal(joined.keys[l], prefix.keys[l]));
    EXPECT_TRUE(at::equal(joined.values[l], prefix.values[l]));
  }
  EXPECT_THROW(CartridgeParams::from_prefix(prefix, 6), c10::Error);
}

TEST_F(CartridgeTest, AdamFirstStepMovesEachWeightByLr) {
  auto p = at::randn({3, 4}).set_requires_grad(true);
  auto before = p.detach().clone();
  Adam adam({p}, AdamOptions{});
  (p * at::randn({3, 4})).sum().backward();
  auto sign = p.grad().sign();
  adam.step(0.5);
  // First step: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps).
  EXPECT_TRUE(at::allclose(before - p.detach(), 0.5 * sign, 1e-5, 1e-6));
  adam.zero_grad();
  EXPECT_FALSE(p.grad().defined());
}

TEST_F(CartridgeTest, ResumeEqualsUninterruptedRun) {
  TrainOptions options;
  options.epochs = 2;
  options.batch_size = 2;
  options.grad_accum = 1;
  options.cosine = true;
  auto full = CartridgeParams::from_prefix(prefix, 1);
  auto run = train_cartridge(*model, full, data, options);
  EXPECT_EQ(run.steps, 6);

  const std::string path = ::testing::TempDir() + "cartridge_test.ckpt";
  std::remove(path.c_str());
  options.checkpoint_path = path;
  options.checkpoint_every = 1;
  auto part = CartridgeParams::from_prefix(prefix, 1);
  auto stopped = train_cartridge(*model, part, data, options, [](const TrainProgress& p) { return p.step < 4; });
  EXPECT_TRUE(stopped.cancelled);
  EXPECT_EQ(stopped.steps, 4);
  options.resume = true;
  auto resumed = CartridgeParams::from_prefix(prefix, 1);
  auto rest = train_cartridge(*model, resumed, data, options);
  EXPECT_EQ(rest.steps, 6);
  EXPECT_EQ(rest.losses.size(), 2u);
  auto a = trained(full), b = trained(resumed);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i;
  std::remove(path.c_str());
}

TEST_F(CartridgeTest, CancelBeforeTheFirstStepChangesNothing) {
  auto params = CartridgeParams::from_prefix(prefix, 1);
  auto before = trained(params);
  CancelToken token;
  token.requested = true;
  auto result = train_cartridge(*model, params, data, TrainOptions{}, nullptr, &token.requested);
  EXPECT_TRUE(result.cancelled);
  EXPECT_EQ(result.steps, 0);
  auto after = trained(params);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i]));
  EXPECT_FALSE(params.parameters()[0].grad().defined());
}

// The training order: a permutation, repeatable from (seed, epoch), whose steps group rows of
// similar length (far less padding than a random order) and still mix the data across epochs.
TEST(TrainingOrder, PermutationOfSimilarLengthsPerStep) {
  const int64_t n = 203, per_step = 4;
  auto lengths = at::randint(2, 200, {n}, at::kLong);
  auto order = training_order(lengths, per_step, /*seed=*/3, /*epoch=*/0);
  auto sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(order, training_order(lengths, per_step, 3, 0));
  EXPECT_NE(order, training_order(lengths, per_step, 3, 1));
  EXPECT_NE(order, training_order(lengths, per_step, 4, 0));

  auto padded_rows = [&](const std::vector<int64_t>& o) {
    int64_t total = 0;
    for (int64_t begin = 0; begin < n; begin += per_step) {
      const int64_t end = std::min(begin + per_step, n);
      int64_t longest = 0;
      for (int64_t i = begin; i < end; ++i) longest = std::max(longest, lengths[o[i]].item<int64_t>());
      total += longest * (end - begin);
    }
    return total;
  };
  auto random_order = at::randperm(n, at::kLong);
  std::vector<int64_t> shuffled(random_order.data_ptr<int64_t>(), random_order.data_ptr<int64_t>() + n);
  const int64_t real = lengths.sum().item<int64_t>();
  EXPECT_LT(padded_rows(order) - real, (padded_rows(shuffled) - real) / 4);
  // Steps are not sorted across the epoch: the first half holds long rows as well as short.
  int64_t longest_first_half = 0;
  for (int64_t i = 0; i < n / 2; ++i) longest_first_half = std::max(longest_first_half, lengths[order[i]].item<int64_t>());
  EXPECT_GT(longest_first_half, 150);
}
