// Sampling: greedy, top-k and top-p keep the right tokens, seeds repeat.
#include <gtest/gtest.h>

#include "cartridges/engine.h"

#include <limits>

using namespace cartridges;

namespace {
at::Tensor kept(std::vector<int64_t> flags) { return at::tensor(flags, at::kLong).to(at::kBool); }
}  // namespace

TEST(SamplingTest, GreedyTakesArgmax) {
  Sampler sampler(SamplingParams{});
  auto logits = at::tensor({0.1f, 2.0f, -1.0f, 1.9f});
  EXPECT_EQ(sampler.sample(logits), 1);
}

TEST(SamplingTest, FirstArgmaxAgreesWithAten) {
  at::manual_seed(0);
  // Lengths around the vector width and the tail, the vocabulary's; ties, infinities, NaN.
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 100, 49152, 49159}) {
    std::vector<at::Tensor> rows = {at::randn({n}), at::randint(0, 3, {n}).to(at::kFloat),
                                    at::full({n}, -std::numeric_limits<float>::infinity()), at::zeros({n})};
    auto with_nan = at::randn({n});
    with_nan[n / 2] = std::numeric_limits<float>::quiet_NaN();
    rows.push_back(with_nan);
    auto last = at::randn({n});
    last[n - 1] = 100.f;  // the largest in the tail
    rows.push_back(last);
    auto signed_zeros = at::zeros({n});
    signed_zeros.narrow(0, 0, (n + 1) / 2).fill_(-0.f);  // -0 == 0: the first index wins
    rows.push_back(signed_zeros);
    for (const auto& row : rows) {
      EXPECT_EQ(first_argmax(row), row.argmax().item<int64_t>()) << "n = " << n;
    }
  }
  // A strided row (a column of a matrix) goes to ATen.
  auto matrix = at::randn({64, 3});
  EXPECT_EQ(first_argmax(matrix.select(1, 1)), matrix.select(1, 1).argmax().item<int64_t>());
}

TEST(SamplingTest, TopKKeepsExactlyKMostLikely) {
  auto logits = at::tensor({0.5f, 3.0f, -2.0f, 1.0f, 2.0f});
  auto finite = at::isfinite(filter_top_k(logits, 2));
  EXPECT_TRUE(finite.equal(kept({0, 1, 0, 0, 1})));
}

TEST(SamplingTest, TopPKeepsSmallestSetWithMass) {
  // Probabilities 0.5, 0.25, 0.125, 0.125 (as logits of their logs).
  auto logits = at::log(at::tensor({0.125f, 0.5f, 0.125f, 0.25f}));
  EXPECT_TRUE(at::isfinite(filter_top_p(logits, 0.5)).equal(kept({0, 1, 0, 0})));
  EXPECT_TRUE(at::isfinite(filter_top_p(logits, 0.6)).equal(kept({0, 1, 0, 1})));
  EXPECT_TRUE(at::isfinite(filter_top_p(logits, 0.75)).equal(kept({0, 1, 0, 1})));
  auto kept08 = at::isfinite(filter_top_p(logits, 0.8));
  EXPECT_EQ(kept08.sum().item<int64_t>(), 3);  // a tie at the boundary keeps one of the two
  // The kept set holds at least p of the mass.
  auto probs = logits.exp();
  for (double p : {0.1, 0.3, 0.55, 0.9, 0.99}) {
    auto keep = at::isfinite(filter_top_p(logits, p));
    EXPECT_GE(probs.masked_select(keep).sum().item<float>() + 1e-6, p);
  }
}

TEST(SamplingTest, SampledTokensStayInsideTopK) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_k = 3;
  params.seed = 7;
  Sampler sampler(params);
  auto logits = at::tensor({5.0f, 4.0f, 3.0f, 2.9f, 0.0f});
  for (int i = 0; i < 200; ++i) EXPECT_LT(sampler.sample(logits), 3);
}

TEST(SamplingTest, FrequenciesFollowProbabilities) {
  SamplingParams params;
  params.temperature = 1.0;
  params.seed = 3;
  Sampler sampler(params);
  auto logits = at::log(at::tensor({0.7f, 0.2f, 0.1f}));
  std::vector<int> counts(3, 0);
  const int n = 4000;
  for (int i = 0; i < n; ++i) counts[sampler.sample(logits)]++;
  EXPECT_NEAR(counts[0] / double(n), 0.7, 0.03);
  EXPECT_NEAR(counts[1] / double(n), 0.2, 0.03);
  EXPECT_NEAR(counts[2] / double(n), 0.1, 0.03);
}

TEST(SamplingTest, SameSeedRepeats) {
  SamplingParams params;
  params.temperature = 0.9;
  params.top_p = 0.95;
  params.seed = 1234;
  auto logits = at::randn({100});
  Sampler a(params), b(params);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.sample(logits), b.sample(logits));
  params.seed = 99;
  Sampler c(params);
  int differ = 0;
  Sampler a2(SamplingParams{0.9, 0.95, 0, 1234, 256, {}});
  for (int i = 0; i < 50; ++i) differ += a2.sample(logits) != c.sample(logits);
  EXPECT_GT(differ, 0);
}

TEST(SamplingTest, LogitBiasShiftsAndBansTokens) {
  auto logits = at::tensor({0.1f, 2.0f, -1.0f, 1.9f});
  SamplingParams greedy;
  greedy.logit_bias = {{1, -100.0}};
  EXPECT_EQ(Sampler(greedy).sample(logits), 3);  // the argmax is banned: the runner-up wins
  greedy.logit_bias = {{2, 3.5}};
  EXPECT_EQ(Sampler(greedy).sample(logits), 2);  // -1 + 3.5 beats 2.0
  EXPECT_TRUE(apply_logit_bias(logits, {{0, 1.0}, {3, -0.5}}).allclose(at::tensor({1.1f, 2.0f, -1.0f, 1.4f})));

  SamplingParams sampled;
  sampled.temperature = 1.0;
  sampled.seed = 5;
  sampled.logit_bias = {{0, -100.0}, {1, -100.0}};
  Sampler sampler(sampled);
  for (int i = 0; i < 200; ++i) {
    const auto token = sampler.sample(logits);
    EXPECT_TRUE(token == 2 || token == 3);
  }
}

TEST(SamplingTest, LogitBiasOutsideTheVocabularyOrRangeIsRefused) {
  SamplingParams params;
  params.logit_bias = {{4, 1.0}};
  EXPECT_THROW(Sampler(params).sample(at::zeros({4})), c10::Error);
  params.logit_bias = {{-1, 1.0}};
  EXPECT_THROW(Sampler{params}, c10::Error);
  params.logit_bias = {{0, 101.0}};
  EXPECT_THROW(Sampler{params}, c10::Error);
}
