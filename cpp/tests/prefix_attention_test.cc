// The bfloat16 prefix-attention kernel (model/prefix_attention_bf16.cpp) against attention
// written the long way in float32 on the same bfloat16 inputs, and split attention's output and
// gradients with the kernel against the same with ATen's fused attention.
#include <gtest/gtest.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>

#include "model/prefix_attention_bf16.h"
#include "model/split_attention.h"

using namespace cartridges;

namespace {

// softmax(q k^T / sqrt(D) + bias) v and the log-sum-exp, in float32.
std::pair<at::Tensor, at::Tensor> reference(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                            const at::Tensor& bias) {
  const auto dim = q.size(3);
  auto scores = at::matmul(q.to(at::kFloat), keys.to(at::kFloat).transpose(1, 2).unsqueeze(0)) /
                std::sqrt(static_cast<double>(dim));
  if (bias.defined()) scores = scores + bias.unsqueeze(0).unsqueeze(2);
  auto lse = at::logsumexp(scores, -1);
  return {at::matmul(at::softmax(scores, -1), values.to(at::kFloat).unsqueeze(0)), lse};
}

// |got - want| / |want|, or |got - want| where want is 0 (one key: the query's gradient).
double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const double error = (got.to(at::kFloat) - want).norm().item<double>(), size = want.norm().item<double>();
  return size > 0 ? error / size : error;
}

}  // namespace

// Shapes that exercise every tail: query rows not a multiple of 16, prefixes shorter than a
// tile and not a multiple of 64, both head sizes, several sequences, with and without biases.
TEST(PrefixAttentionBf16Test, MatchesFloat32Reference) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(0);
  struct Case {
    int64_t sequences, heads, rows, prefix, dim;
    bool biased;
  };
  for (const Case& c : {Case{1, 3, 50, 1024, 64, false}, Case{2, 3, 7, 37, 64, true}, Case{3, 2, 33, 130, 128, true},
                        Case{1, 1, 16, 64, 64, false}, Case{1, 2, 1, 5, 128, false}}) {
    auto q = at::randn({c.sequences, c.heads, c.rows, c.dim}).to(at::kBFloat16);
    auto keys = at::randn({c.heads, c.prefix, c.dim}).to(at::kBFloat16);
    auto values = at::randn({c.heads, c.prefix, c.dim}).to(at::kBFloat16);
    at::Tensor bias = c.biased ? at::randn({c.heads, c.prefix}) * 2 : at::Tensor();
    auto [out, lse] = ops::prefix_attention_bf16(q, keys, values, bias);
    auto [want_out, want_lse] = reference(q, keys, values, bias);
    const std::string where = "rows " + std::to_string(c.rows) + ", prefix " + std::to_string(c.prefix) + ", dim " +
                              std::to_string(c.dim);
    ASSERT_EQ(out.sizes(), want_out.sizes()) << where;
    // The output is rounded to bfloat16 (2^-9 relative) and so are the probabilities that
    // weigh the values; the log-sum-exp is float32 throughout.
    EXPECT_LT(relative_error(out, want_out), 8e-3) << where;
    EXPECT_TRUE(at::allclose(lse, want_lse, 1e-4, 1e-4)) << where;
  }
}

// Keys and values given as strided views (a [P, H_kv, D] tensor transposed) read as their copies do.
TEST(PrefixAttentionBf16Test, StridedKeysMatchContiguousOnes) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(6);
  auto q = at::randn({1, 3, 20, 64}).to(at::kBFloat16);
  for (int64_t P : {64, 100}) {  // a whole tile (no padding) and a padded one
    auto keys = at::randn({P, 3, 64}).to(at::kBFloat16).transpose(0, 1);
    auto values = at::randn({P, 3, 64}).to(at::kBFloat16).transpose(0, 1);
    ASSERT_FALSE(keys.is_contiguous());
    auto [out, lse] = ops::prefix_attention_bf16(q, keys, values, at::Tensor());
    auto [want_out, want_lse] = ops::prefix_attention_bf16(q, keys.contiguous(), values.contiguous(), at::Tensor());
    EXPECT_TRUE(at::equal(out, want_out)) << "P " << P;
    EXPECT_TRUE(at::equal(lse, want_lse)) << "P " << P;
  }
}

// A prefix whose every key carries -inf bias but one: only that key's value comes out.
TEST(PrefixAttentionBf16Test, MaskedKeysGetNoWeight) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(1);
  auto q = at::randn({1, 1, 20, 64}).to(at::kBFloat16);
  auto keys = at::randn({1, 200, 64}).to(at::kBFloat16), values = at::randn({1, 200, 64}).to(at::kBFloat16);
  auto bias = at::full({1, 200}, -std::numeric_limits<float>::infinity());
  bias[0][150] = 0.f;
  auto [out, lse] = ops::prefix_attention_bf16(q, keys, values, bias);
  EXPECT_TRUE(at::equal(out[0][0], values[0][150].expand({20, 64})));
  auto scores = at::matmul(q.to(at::kFloat)[0][0], keys.to(at::kFloat)[0][150]) / 8.0;
  EXPECT_TRUE(at::allclose(lse[0][0], scores, 1e-4, 1e-4));
}

// Split attention in bfloat16 with the kernel for the prefix part, against the same with ATen's
// fused attention: output and every gradient, biased and plain prefixes, both foldings.
TEST(PrefixAttentionBf16Test, SplitAttentionMatchesAtenPath) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(2);
  const int64_t B = 3, H = 9, Hkv = 3, S = 40, D = 64, P = 300;
  const int threads = at::get_num_threads();
  for (int fold_threads : {1, 2}) {  // one sequence per KV head, or one per row and KV head
    at::set_num_threads(fold_threads);
    for (bool biased : {false, true}) {
      auto q = at::randn({B, H, S, D}).to(at::kBFloat16).requires_grad_();
      auto k = at::randn({B, Hkv, S, D}).to(at::kBFloat16).requires_grad_();
      auto v = at::randn({B, Hkv, S, D}).to(at::kBFloat16).requires_grad_();
      auto pk = at::randn({Hkv, P, D}).to(at::kBFloat16).requires_grad_();
      auto pv = at::randn({Hkv, P, D}).to(at::kBFloat16).requires_grad_();
      at::Tensor bias = biased ? at::randn({Hkv, P}) : at::Tensor();
      auto weight = at::randn({B, H, S, D});
      auto run = [&](bool kernel) {
        const bool before = ops::allow_prefix_attention_bf16_for_testing(kernel);
        auto out = ops::split_attention_cpu(q, k, v, at::Tensor(), /*own_causal=*/true, pk, pv, bias);
        auto grads = torch::autograd::grad({(out.to(at::kFloat) * weight).sum()}, {q, k, v, pk, pv});
        ops::allow_prefix_attention_bf16_for_testing(before);
        grads.insert(grads.begin(), out);
        return grads;
      };
      auto got = run(true), want = run(false);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_LT(relative_error(got[i], want[i].to(at::kFloat)), 1.5e-2)
            << fold_threads << " threads, " << (biased ? "biased" : "plain") << ", tensor " << i;
      }
    }
  }
  at::set_num_threads(threads);
}

// The backward against autograd through the float32 reference, on the same bfloat16 inputs:
// every gradient about as close as ATen's fused backward in bfloat16 gets (each rounds its
// probabilities and score gradients to bfloat16), with a bias, tails of rows and keys, both
// head sizes and several sequences (whose dk, dv add up).
TEST(PrefixAttentionBf16Test, BackwardMatchesFloat32Reference) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(3);
  for (int64_t dim : {64, 128}) {
    const int64_t N = 2, Hkv = 3, L = 45, P = 150;
    auto q = at::randn({N, Hkv, L, dim}).to(at::kBFloat16);
    auto keys = at::randn({Hkv, P, dim}).to(at::kBFloat16), values = at::randn({Hkv, P, dim}).to(at::kBFloat16);
    auto bias = at::randn({Hkv, P});
    auto grad = at::randn({N, Hkv, L, dim}).to(at::kBFloat16);
    auto [out, lse] = ops::prefix_attention_bf16(q, keys, values, bias);
    auto [dq, dk, dv] = ops::prefix_attention_bf16_backward(grad, q, keys, values, bias, out, lse);

    auto qf = q.to(at::kFloat).requires_grad_(), kf = keys.to(at::kFloat).requires_grad_();
    auto vf = values.to(at::kFloat).requires_grad_();
    auto want_out = reference(qf, kf, vf, bias).first;
    auto want = torch::autograd::grad({(want_out * grad.to(at::kFloat)).sum()}, {qf, kf, vf});
    auto mask = bias.to(at::kBFloat16).view({1, Hkv, 1, P}).expand({N, -1, -1, -1});
    auto [aten_out, aten_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        q, keys.unsqueeze(0).expand({N, -1, -1, -1}), values.unsqueeze(0).expand({N, -1, -1, -1}), 0.0, false, mask);
    auto aten = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, keys.unsqueeze(0).expand({N, -1, -1, -1}), values.unsqueeze(0).expand({N, -1, -1, -1}), aten_out,
        aten_lse, 0.0, false, mask);
    // ATen sees the bias rounded to bfloat16; the reference sees it in float32.
    const at::Tensor got[] = {dq, dk, dv};
    const at::Tensor from_aten[] = {std::get<0>(aten), std::get<1>(aten).sum(0), std::get<2>(aten).sum(0)};
    for (int i = 0; i < 3; ++i) {
      const double error = relative_error(got[i], want[i]), aten_error = relative_error(from_aten[i], want[i]);
      EXPECT_LT(error, 5e-3) << "dim " << dim << ", gradient " << i;
      EXPECT_LT(error, 1.5 * aten_error + 1e-3) << "dim " << dim << ", gradient " << i << ", ATen's error " << aten_error;
    }
  }
}

// A float32 q asking for bfloat16 attention (self-study's teacher): close to the float32
// attention, and without effect when a gradient is wanted.
TEST(PrefixAttentionBf16Test, Float32QueriesAskingForBfloat16) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(4);
  const int64_t B = 2, H = 9, Hkv = 3, S = 30, D = 64, P = 200;
  auto q = at::randn({B, H, S, D}), k = at::randn({B, Hkv, S, D}), v = at::randn({B, Hkv, S, D});
  auto pk = at::randn({Hkv, P, D}), pv = at::randn({Hkv, P, D}), bias = at::randn({Hkv, P});
  auto exact = ops::split_attention_cpu(q, k, v, at::Tensor(), true, pk, pv, bias);
  auto rounded = ops::split_attention_cpu(q, k, v, at::Tensor(), true, pk, pv, bias, /*bfloat16_attention=*/true);
  EXPECT_EQ(rounded.scalar_type(), at::kFloat);
  EXPECT_FALSE(at::equal(rounded, exact));
  EXPECT_LT(relative_error(rounded, exact), 8e-3);
  q.requires_grad_();
  EXPECT_TRUE(at::equal(ops::split_attention_cpu(q, k, v, at::Tensor(), true, pk, pv, bias, true), exact));
}

// The causal kernel (each sequence's queries, heads folded per KV head, over its own keys)
// against the float32 reference, forward and backward, at lengths that are not whole tiles.
TEST(PrefixAttentionBf16Test, CausalMatchesFloat32Reference) {
  if (!ops::prefix_attention_bf16_supported(64)) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  at::manual_seed(5);
  for (int64_t T : {1, 37, 130}) {
    const int64_t N = 2, Hkv = 3, G = 3, D = 64;
    auto q = at::randn({N, Hkv, G * T, D}).to(at::kBFloat16);
    auto keys = at::randn({N, Hkv, T, D}).to(at::kBFloat16), values = at::randn({N, Hkv, T, D}).to(at::kBFloat16);
    auto grad = at::randn({N, Hkv, G * T, D}).to(at::kBFloat16);
    auto [out, lse] = ops::causal_attention_bf16(q, keys, values);
    auto [dq, dk, dv] = ops::causal_attention_bf16_backward(grad, q, keys, values, out, lse);

    auto qf = q.to(at::kFloat).requires_grad_(), kf = keys.to(at::kFloat).requires_grad_();
    auto vf = values.to(at::kFloat).requires_grad_();
    auto position = at::arange(T).repeat({G});  // query row g * T + i is at position i
    auto hidden = at::arange(T).unsqueeze(0) > position.unsqueeze(1);
    auto scores = at::matmul(qf, kf.transpose(2, 3)) / 8.0;
    scores = scores.masked_fill(hidden, -std::numeric_limits<float>::infinity());
    auto want_out = at::matmul(at::softmax(scores, -1), vf);
    EXPECT_LT(relative_error(out, want_out.detach()), 8e-3) << "T " << T;
    EXPECT_TRUE(at::allclose(lse, at::logsumexp(scores, -1).detach(), 1e-4, 1e-4)) << "T " << T;
    auto want = torch::autograd::grad({(want_out * grad.to(at::kFloat)).sum()}, {qf, kf, vf});
    const at::Tensor got[] = {dq, dk, dv};
    for (int i = 0; i < 3; ++i) EXPECT_LT(relative_error(got[i], want[i]), 8e-3) << "T " << T << ", gradient " << i;
  }
}
