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

TEST_F(CartridgeTest, AdamLrScalesScaleEachParametersFirstStep) {
  auto a = at::randn({3, 4}).set_requires_grad(true), b = at::randn({2, 5}).set_requires_grad(true);
  auto a0 = a.detach().clone(), b0 = b.detach().clone();
  Adam adam({a, b}, AdamOptions{}, {0.25, 2.0});
  (a * at::randn({3, 4})).sum().backward();
  (b * at::randn({2, 5})).sum().backward();
  adam.step(0.1);
  EXPECT_TRUE(at::allclose(a0 - a.detach(), 0.025 * a.grad().sign(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(b0 - b.detach(), 0.2 * b.grad().sign(), 1e-5, 1e-6));
  EXPECT_THROW(Adam({a, b}, AdamOptions{}, {1.0}), c10::Error);
}

TEST(AdamTest, ChannelScalesMultiplyEachElementsStep) {
  auto a = at::randn({2, 3, 4}).set_requires_grad(true);
  auto a0 = a.detach().clone();
  auto scales = at::rand({2, 1, 4});
  Adam adam({a}, AdamOptions{}, {}, {scales});
  (a * at::randn({2, 3, 4})).sum().backward();
  adam.step(0.1);  // Adam's first step: lr x sign(grad), here times each channel's scale
  EXPECT_TRUE(at::allclose(a0 - a.detach(), 0.1 * scales * a.grad().sign(), 1e-5, 1e-6));
  EXPECT_THROW(Adam({a}, AdamOptions{}, {}, {at::ones({2, 1, 3})}), c10::Error);
}

TEST_F(CartridgeTest, ChannelLrScalesOfEqualChannelsAreTheLayerScales) {
  auto params = CartridgeParams::from_prefix(prefix, 1);
  for (auto& k : params.trainable_keys) k.detach().fill_(3.0);
  for (auto& v : params.trainable_values) v.detach().fill_(-0.5);
  params.trainable_values[0].detach().fill_(-1.0);
  auto layer = layer_lr_scales(params);
  auto channel = channel_lr_scales(params);
  ASSERT_EQ(channel.size(), layer.size());
  for (size_t i = 0; i < channel.size(); ++i) {
    EXPECT_EQ(channel[i].size(1), 1);
    EXPECT_TRUE(at::allclose(channel[i], at::full_like(channel[i], layer[i]), 1e-6, 1e-7)) << "parameter " << i;
  }
}

TEST_F(CartridgeTest, LayerLrScalesAreOneForLayersOfEqualScale) {
  auto params = CartridgeParams::from_prefix(prefix, 1);
  auto scales = layer_lr_scales(params);
  ASSERT_EQ(scales.size(), static_cast<size_t>(2 * config.num_layers));
  // Every layer's keys scaled to the same RMS: all scales 1.
  for (auto& k : params.trainable_keys) k.detach().fill_(3.0);
  for (auto& v : params.trainable_values) v.detach().fill_(-0.5);
  for (double s : layer_lr_scales(params)) EXPECT_NEAR(s, 1.0, 1e-12);
  // Layer 0's values at twice the others': its scale over the others' is 2.
  params.trainable_values[0].detach().fill_(-1.0);
  auto uneven = layer_lr_scales(params);
  EXPECT_NEAR(uneven[config.num_layers] / uneven[config.num_layers + 1], 2.0, 1e-12);
}

TEST(LearningRateSchedule, WarmupThenCosine) {
  TrainOptions options;
  options.adam.lr = 0.1;
  options.cosine = true;
  options.warmup = 0.2;  // 2 of 10 steps
  EXPECT_DOUBLE_EQ(options.lr_at(0, 10), 0.05);
  EXPECT_DOUBLE_EQ(options.lr_at(1, 10), 0.1);
  EXPECT_DOUBLE_EQ(options.lr_at(2, 10), 0.1);  // the cosine's first step
  EXPECT_NEAR(options.lr_at(6, 10), 0.05, 1e-12);  // half way through the 8 cosine steps
  EXPECT_LT(options.lr_at(9, 10), 0.01);
  options.warmup = 0.0;  // the cosine over all steps, as before warmup existed
  EXPECT_NEAR(options.lr_at(5, 10), 0.05, 1e-12);
  options.cosine = false;
  EXPECT_DOUBLE_EQ(options.lr_at(9, 10), 0.1);
  options.warmup = 1.0;
  EXPECT_THROW(options.lr_at(0, 10), c10::Error);
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

// The training order is a permutation, repeatable from (seed, epoch).
TEST(TrainingOrder, RepeatablePermutation) {
  auto order = training_order(203, /*seed=*/3, /*epoch=*/0);
  auto sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 203; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(order, training_order(203, 3, 0));
  EXPECT_NE(order, training_order(203, 3, 1));
  EXPECT_NE(order, training_order(203, 4, 0));
}

// Length groups cover the rows once, split short rows from long ones, and keep rows of
// similar length together.
TEST(LengthGroups, SplitShortFromLong) {
  auto lengths = at::tensor(std::vector<int64_t>{5, 120, 6, 130, 7, 125, 4, 128}, at::kLong);
  auto groups = length_groups({0, 1, 2, 3, 4, 5, 6, 7}, lengths, 32);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0], (std::vector<int64_t>{6, 0, 2, 4}));
  EXPECT_EQ(groups[1], (std::vector<int64_t>{1, 5, 7, 3}));
  EXPECT_EQ(length_groups({1, 3}, lengths, 32).size(), 1u);  // 120 and 130: one call is cheaper
  EXPECT_EQ(length_groups({0, 3}, lengths, 32).size(), 2u);  // 5 and 130: two calls
  EXPECT_TRUE(length_groups({}, lengths, 32).empty());
}

// A micro-batch's loss and gradient are the sums of its length groups' (padding changes nothing).
TEST_F(CartridgeTest, LossOfLengthGroupsSumsToTheWholeBatch) {
  auto rows = next_token_data(4, config.vocab_size);
  rows.lengths = at::tensor(std::vector<int64_t>{3, 10, 4, 9}, at::kLong);
  auto valid = at::arange(10, at::kLong).unsqueeze(0) < (rows.lengths - 1).unsqueeze(1);
  rows.target_mask = valid;
  auto positions = valid.nonzero();
  rows.topk_ids = rows.tokens.index({positions.select(1, 0), positions.select(1, 1) + 1}).unsqueeze(1).contiguous();
  rows.topk_logprobs = at::zeros({rows.topk_ids.size(0), 1}, at::kFloat);
  auto grads = [&](const std::vector<std::vector<int64_t>>& groups) {
    auto params = CartridgeParams::from_prefix(prefix, 1);
    double total = 0;
    for (const auto& group : groups) {
      auto [loss, count] = distillation_loss_sum(*model, params, rows, group, nullptr, 0);
      loss.backward();
      total += loss.item<double>();
    }
    std::vector<at::Tensor> out{at::scalar_tensor(total)};
    for (const auto& p : params.parameters()) out.push_back(p.grad().clone());
    return out;
  };
  auto groups = length_groups({0, 1, 2, 3}, rows.lengths, 4);  // {3, 4} and {9, 10}
  ASSERT_EQ(groups.size(), 2u);
  auto whole = grads({{0, 1, 2, 3}}), split = grads(groups);
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(at::allclose(whole[i], split[i], 1e-4, 1e-5)) << i;
}
