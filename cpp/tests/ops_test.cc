// RoPE, RMSNorm and attention against straightforward reference computations.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>

#include "model/fused_cpu.h"
#include "model/ops.h"

using namespace cartridges;

namespace {

LlamaConfig rope_config(const std::string& type) {
  LlamaConfig c;
  c.head_dim = 16;
  c.rope_theta = 500000.0;
  c.rope_type = type;
  c.rope_factor = 8.0;
  c.rope_low_freq_factor = 1.0;
  c.rope_high_freq_factor = 4.0;
  c.rope_original_max_position_embeddings = 64;  // small, so all three frequency bands occur
  return c;
}

// The Llama 3 rule, frequency by frequency, in double precision.
double llama3_frequency(double f, const LlamaConfig& c) {
  const double wavelen = 2 * M_PI / f;
  const double low_wavelen = c.rope_original_max_position_embeddings / c.rope_low_freq_factor;
  const double high_wavelen = c.rope_original_max_position_embeddings / c.rope_high_freq_factor;
  if (wavelen < high_wavelen) return f;
  if (wavelen > low_wavelen) return f / c.rope_factor;
  const double smooth = (c.rope_original_max_position_embeddings / wavelen - c.rope_low_freq_factor) /
                        (c.rope_high_freq_factor - c.rope_low_freq_factor);
  return (1 - smooth) * f / c.rope_factor + smooth * f;
}

}  // namespace

TEST(RopeTest, DefaultFrequenciesFollowTheta) {
  auto c = rope_config("default");
  auto inv = ops::rope_inv_freq(c);
  ASSERT_EQ(inv.size(0), 8);
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_NEAR(inv[i].item<float>(), std::pow(c.rope_theta, -2.0 * i / 16), 1e-6);
  }
}

TEST(RopeTest, Llama3ScalingCoversAllBands) {
  auto c = rope_config("llama3");
  auto scaled = ops::rope_inv_freq(c);
  auto plain = ops::rope_inv_freq(rope_config("default"));
  int unchanged = 0, divided = 0, smoothed = 0;
  for (int64_t i = 0; i < 8; ++i) {
    const double f = plain[i].item<float>();
    const double expected = llama3_frequency(f, c);
    EXPECT_NEAR(scaled[i].item<float>(), expected, 1e-6 * std::max(1.0, expected));
    if (expected == f) ++unchanged;
    else if (std::abs(expected - f / c.rope_factor) < 1e-12) ++divided;
    else ++smoothed;
  }
  EXPECT_GT(unchanged, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
}

TEST(RopeTest, RotatesPairsByPositionAngle) {
  auto c = rope_config("default");
  auto inv = ops::rope_inv_freq(c);
  auto positions = at::tensor({0L, 3L, 17L}, at::kLong).view({1, 3});
  auto [cos, sin] = ops::rope_cos_sin(inv, positions, at::kFloat);
  auto x = at::randn({1, 2, 3, 16});
  auto y = ops::apply_rope(x, cos, sin);
  for (int64_t s = 0; s < 3; ++s) {
    const double pos = positions[0][s].item<int64_t>();
    for (int64_t i = 0; i < 8; ++i) {
      const double angle = pos * inv[i].item<float>();
      for (int64_t h = 0; h < 2; ++h) {
        const double a = x[0][h][s][i].item<float>(), b = x[0][h][s][i + 8].item<float>();
        EXPECT_NEAR(y[0][h][s][i].item<float>(), a * std::cos(angle) - b * std::sin(angle), 1e-4);
        EXPECT_NEAR(y[0][h][s][i + 8].item<float>(), b * std::cos(angle) + a * std::sin(angle), 1e-4);
      }
    }
  }
}

TEST(RmsNormTest, MatchesDefinition) {
  auto x = at::randn({2, 3, 8});
  auto w = at::randn({8});
  auto y = ops::rms_norm(x, w, 1e-6);
  auto expected = w * x / at::sqrt(x.pow(2).mean(-1, true) + 1e-6);
  EXPECT_TRUE(at::allclose(y, expected, 1e-5, 1e-6));
}

namespace {

// The ATen expressions the fused CPU kernels replace (model/fused_cpu.h).
at::Tensor aten_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

at::Tensor aten_swiglu(const at::Tensor& gate_up) {
  const auto I = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, I)) * gate_up.narrow(-1, I, I);
}

// Forward and gradient of the fused op against the ATen expression, the gradient computed from
// the same bfloat16 or float32 inputs in float64 (the reference both are judged against).
void expect_fused_matches(const std::function<at::Tensor(const at::Tensor&)>& fused,
                          const std::function<at::Tensor(const at::Tensor&)>& aten, const at::Tensor& input,
                          at::ScalarType dtype, double forward_tol, double grad_tol) {
  auto x = input.to(dtype).requires_grad_(true);
  auto y = fused(x);
  ASSERT_EQ(y.scalar_type(), dtype);
  auto x64 = x.detach().to(at::kDouble).requires_grad_(true);
  auto y64 = aten(x64);
  auto expected_aten = aten(x.detach()).to(at::kDouble);
  const double scale = y64.abs().max().item<double>();
  EXPECT_LT((y.to(at::kDouble) - y64).abs().max().item<double>(), forward_tol * scale);
  // Within the rounding the ATen expression itself makes.
  EXPECT_LT((y.to(at::kDouble) - y64).abs().max().item<double>(),
            2 * (expected_aten - y64).abs().max().item<double>() + 1e-6 * scale);
  auto grad = at::randn(y.sizes());
  auto dx = torch::autograd::grad({y}, {x}, {grad.to(dtype)})[0];
  auto dx64 = torch::autograd::grad({y64}, {x64}, {grad.to(dtype).to(at::kDouble)})[0];
  const double grad_scale = dx64.abs().max().item<double>();
  EXPECT_LT((dx.to(at::kDouble) - dx64).abs().max().item<double>(), grad_tol * grad_scale);
  EXPECT_GT(dx.abs().max().item<double>(), 0.0);
}

}  // namespace

TEST(RmsNormTest, FusedCpuMatchesAtenForwardAndGradient) {
  // 577 features: a tail past the last 16 lanes; rows enough for several threads' tasks.
  for (int64_t features : {576L, 577L, 8L}) {
    auto x = at::randn({3, 70, features}) * 3;
    auto w = at::randn({features});
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const auto wd = w.to(dtype);
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      expect_fused_matches([&](const at::Tensor& t) { return ops::rms_norm(t, wd, 1e-5); },
                           [&](const at::Tensor& t) { return aten_rms_norm(t, w.to(t.scalar_type()), 1e-5); }, x,
                           dtype, tol, tol);
    }
  }
}

TEST(RmsNormTest, FusedCpuRoundsAsTheAtenExpression) {
  // bfloat16: x * scale rounded, then weight times it rounded, so most outputs equal ATen's bits.
  auto x = (at::randn({64, 576}) * 3).to(at::kBFloat16);
  auto w = at::randn({576}).to(at::kBFloat16);
  auto fused = ops::rms_norm(x, w, 1e-5);
  auto aten = aten_rms_norm(x, w, 1e-5);
  EXPECT_GT(fused.eq(aten).to(at::kFloat).mean().item<float>(), 0.95);
  // A strided x (a view across rows) reads as its copy does.
  auto wide = at::randn({64, 1152}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(ops::rms_norm(wide.narrow(1, 100, 576), w, 1e-5),
                        ops::rms_norm(wide.narrow(1, 100, 576).contiguous(), w, 1e-5)));
}

TEST(SwigluTest, FusedCpuMatchesAtenForwardAndGradient) {
  for (int64_t width : {1536L, 37L}) {
    // Gates over a wide range, with the extremes where exp saturates.
    auto x = at::randn({2, 65, 2 * width}) * 4;
    x.index_put_({0, 0, 0}, -120.0);
    x.index_put_({0, 0, 1}, 95.0);
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      expect_fused_matches([](const at::Tensor& t) { return ops::swiglu(t); }, aten_swiglu, x, dtype, tol, tol);
    }
  }
}

TEST(SwigluTest, FusedCpuNeedsNoGradientToRun) {
  auto x = at::randn({5, 64});
  auto y = ops::swiglu(x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(at::allclose(y, aten_swiglu(x), 1e-5, 1e-6));
}

TEST(RopeTest, RopeAndStoreEqualsApplyRopeAndIndexCopy) {
  auto c = rope_config("default");
  const int64_t tokens = 5, heads = 4, kv = 2, dim = 16, capacity = 12;
  auto inv = ops::rope_inv_freq(c);
  auto positions = at::tensor({0L, 1L, 7L, 30L, 2L}, at::kLong).view({1, tokens});
  auto [cos, sin] = ops::rope_cos_sin(inv, positions, at::kFloat);  // [1, 1, N, D]
  // q, k, v as views into one projection, as project_qkv makes them.
  auto qkv = at::randn({tokens, (heads + 2 * kv) * dim});
  auto q = qkv.narrow(1, 0, heads * dim).view({tokens, heads, dim});
  auto k = qkv.narrow(1, heads * dim, kv * dim).view({tokens, kv, dim});
  auto v = qkv.narrow(1, (heads + kv) * dim, kv * dim).view({tokens, kv, dim});
  std::vector<int64_t> slots = {3, 4, 9, 0, 11};
  auto slot_index = at::tensor(slots, at::kLong);

  auto keys = at::zeros({capacity, kv, dim}), values = at::zeros({capacity, kv, dim});
  auto got_q = ops::rope_and_store_cpu(q, k, v, cos, sin, slots, keys, values);

  auto rotate = [&](const at::Tensor& t) {
    return ops::apply_rope(t.transpose(0, 1).unsqueeze(0), cos, sin).squeeze(0).transpose(0, 1);
  };
  auto expected_keys = at::zeros({capacity, kv, dim}), expected_values = at::zeros({capacity, kv, dim});
  expected_keys.index_copy_(0, slot_index, rotate(k).contiguous());
  expected_values.index_copy_(0, slot_index, v.contiguous());
  EXPECT_TRUE(at::equal(got_q, rotate(q)));
  EXPECT_TRUE(at::equal(keys, expected_keys));
  EXPECT_TRUE(at::equal(values, expected_values));
}

namespace {

// Attention written the long way: keys = [prefix..., own], KV heads repeated, explicit mask.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::vector<int64_t>& past, const PrefixList& prefixes, int64_t layer) {
  const auto heads = q.size(0), steps = q.size(1), dim = q.size(2), kv_heads = k.size(0);
  std::vector<at::Tensor> ks, vs, bs;
  for (const auto& p : prefixes) {
    ks.push_back(p->keys[layer]);
    vs.push_back(p->values[layer]);
    bs.push_back(p->biases.empty() ? at::zeros({kv_heads, p->num_tokens()}) : p->biases[layer]);
  }
  ks.push_back(k);
  vs.push_back(v);
  bs.push_back(at::zeros({kv_heads, k.size(1)}));
  auto keys = at::cat(ks, 1).repeat_interleave(heads / kv_heads, 0);
  auto values = at::cat(vs, 1).repeat_interleave(heads / kv_heads, 0);
  auto bias = at::cat(bs, 1).repeat_interleave(heads / kv_heads, 0).unsqueeze(1);  // [H, 1, T]
  const int64_t plen = keys.size(1) - k.size(1);
  auto scores = at::matmul(q, keys.transpose(1, 2)) / std::sqrt(static_cast<double>(dim)) + bias;
  for (int64_t i = 0; i < steps; ++i) {
    for (int64_t t = 0; t < k.size(1); ++t) {
      if (t > past[0] + i) scores.select(1, i).select(1, plen + t).fill_(-INFINITY);
    }
  }
  return at::matmul(scores.softmax(-1), values);
}

PrefixPtr random_prefix(int64_t layers, int64_t kv_heads, int64_t len, int64_t dim, bool biased = false) {
  auto p = std::make_shared<KVPrefix>();
  for (int64_t l = 0; l < layers; ++l) {
    p->keys.push_back(at::randn({kv_heads, len, dim}));
    p->values.push_back(at::randn({kv_heads, len, dim}));
    if (biased) p->biases.push_back(at::randn({kv_heads, len}) * 2);
  }
  return p;
}

// `p` with its keys and values requiring gradients.
PrefixPtr trainable(PrefixPtr p) {
  for (const auto& t : p->keys) t.requires_grad_();
  for (const auto& t : p->values) t.requires_grad_();
  return p;
}

}  // namespace

TEST(AttentionTest, PrefixAndCausalMaskMatchReference) {
  at::manual_seed(0);
  const int64_t B = 3, H = 4, Hkv = 2, S = 5, D = 8, T = 9;
  std::vector<int64_t> past = {4, 0, 2};  // own tokens already cached per row
  auto q = at::randn({B, H, S, D});
  auto k = at::randn({B, Hkv, T, D});
  auto v = at::randn({B, Hkv, T, D});
  auto p1 = random_prefix(2, Hkv, 3, D), p2 = random_prefix(2, Hkv, 6, D);
  std::vector<PrefixList> per_row = {{p1}, {p1, p2}, {}};
  auto mask = ops::causal_mask(past, S, T, at::TensorOptions().dtype(at::kFloat));
  auto out = ops::attention(q, k, v, mask, per_row, /*layer=*/1, /*shared=*/false);
  for (int64_t b = 0; b < B; ++b) {
    auto expected = reference_attention(q[b], k[b], v[b], {past[b]}, per_row[b], 1);
    // Only keys up to past + S exist for a row; the reference sees exactly those.
    auto expected_trimmed = reference_attention(q[b], k[b].narrow(1, 0, past[b] + S), v[b].narrow(1, 0, past[b] + S),
                                                {past[b]}, per_row[b], 1);
    EXPECT_TRUE(at::allclose(out[b], expected, 1e-5, 1e-5)) << "row " << b;
    EXPECT_TRUE(at::allclose(out[b], expected_trimmed, 1e-5, 1e-5)) << "row " << b;
  }
}

// Attention biases on a prefix's keys, on the shared and the per-row paths, beside a prefix
// without them.
TEST(AttentionTest, PrefixBiasesMatchReference) {
  at::manual_seed(4);
  const int64_t B = 2, H = 4, Hkv = 2, S = 3, D = 8, T = 5;
  std::vector<int64_t> past = {2, 0};
  auto q = at::randn({B, H, S, D});
  auto k = at::randn({B, Hkv, T, D});
  auto v = at::randn({B, Hkv, T, D});
  auto biased = random_prefix(2, Hkv, 4, D, /*biased=*/true), plain = random_prefix(2, Hkv, 3, D);
  auto mask = ops::causal_mask(past, S, T, at::TensorOptions().dtype(at::kFloat));
  for (bool shared : {true, false}) {
    std::vector<PrefixList> rows = shared ? std::vector<PrefixList>(B, PrefixList{plain, biased})
                                          : std::vector<PrefixList>{{biased}, {plain, biased}};
    auto out = ops::attention(q, k, v, mask, rows, /*layer=*/1, shared);
    for (int64_t b = 0; b < B; ++b) {
      auto expected = reference_attention(q[b], k[b], v[b], {past[b]}, rows[b], 1);
      EXPECT_TRUE(at::allclose(out[b], expected, 1e-5, 1e-5)) << (shared ? "shared" : "per row") << ", row " << b;
    }
  }
}

TEST(AttentionTest, SharedPrefixPathEqualsPerRowPath) {
  at::manual_seed(1);
  const int64_t B = 4, H = 6, Hkv = 3, S = 2, D = 8, T = 7;
  std::vector<int64_t> past = {5, 3, 5, 0};
  auto q = at::randn({B, H, S, D});
  auto k = at::randn({B, Hkv, T, D});
  auto v = at::randn({B, Hkv, T, D});
  auto p = random_prefix(1, Hkv, 4, D);
  std::vector<PrefixList> rows(B, PrefixList{p});
  auto mask = ops::causal_mask(past, S, T, at::TensorOptions().dtype(at::kFloat));
  auto shared = ops::attention(q, k, v, mask, rows, 0, /*shared=*/true);
  auto per_row = ops::attention(q, k, v, mask, rows, 0, /*shared=*/false);
  EXPECT_TRUE(at::allclose(shared, per_row, 1e-5, 1e-6));
}

// The CPU path splits prefix and own keys into two fused attentions; its output and every
// gradient (queries, own keys and values, the prefixes' keys and values) equal the reference's,
// with and without cached past, biased and plain prefixes, grouped query heads.
TEST(AttentionTest, SplitPathGradientsMatchReference) {
  at::manual_seed(5);
  const int64_t B = 3, H = 6, Hkv = 2, S = 5, D = 8;
  const int threads = at::get_num_threads();
  // One thread folds every row into one sequence per KV head; three (not dividing the two KV
  // heads) give each row its own.
  for (int fold_threads : {1, 3}) {
    at::set_num_threads(fold_threads);
    for (bool causal : {true, false}) {
      std::vector<int64_t> past = causal ? std::vector<int64_t>{0, 0, 0} : std::vector<int64_t>{2, 0, 1};
      const int64_t T = causal ? S : 2 + S;
      auto q = at::randn({B, H, S, D}).requires_grad_();
      auto k = at::randn({B, Hkv, T, D}).requires_grad_();
      auto v = at::randn({B, Hkv, T, D}).requires_grad_();
      auto biased = trainable(random_prefix(2, Hkv, 4, D, /*biased=*/true));
      auto plain = trainable(random_prefix(2, Hkv, 3, D));
      PrefixList segments{plain, biased};
      auto mask = ops::causal_mask(past, S, T, at::TensorOptions().dtype(at::kFloat));
      auto grads = [&](const at::Tensor& out, const at::Tensor& weight) {
        std::vector<at::Tensor> inputs{q, k, v, plain->keys[1], plain->values[1], biased->keys[1], biased->values[1]};
        return torch::autograd::grad({(out * weight).sum()}, inputs);
      };
      auto weight = at::randn({B, H, S, D});
      auto out = ops::attention(q, k, v, mask, std::vector<PrefixList>(B, segments), /*layer=*/1, /*shared=*/true,
                                /*own_causal=*/causal);
      std::vector<at::Tensor> rows;
      for (int64_t b = 0; b < B; ++b) rows.push_back(reference_attention(q[b], k[b], v[b], {past[b]}, segments, 1));
      auto expected = at::stack(rows);
      EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-5)) << (causal ? "causal" : "with past");
      auto got = grads(out, weight), want = grads(expected, weight);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::allclose(got[i], want[i], 1e-4, 1e-5))
            << fold_threads << " threads, " << (causal ? "causal" : "with past") << ", input " << i;
      }
    }
  }
  at::set_num_threads(threads);
}

// The GPU's path for rows with different prefix lists (padded to the longest, one batched
// attention): output and gradients equal the reference's, with lists of different lengths, a
// biased prefix beside plain ones, a row without prefix, lists shared by several rows.
TEST(AttentionTest, PaddedPrefixListsMatchReference) {
  at::manual_seed(6);
  const int64_t B = 5, H = 6, Hkv = 2, S = 4, D = 8, T = 6;
  std::vector<int64_t> past = {2, 0, 1, 2, 0};
  auto q = at::randn({B, H, S, D}).requires_grad_();
  auto k = at::randn({B, Hkv, T, D}).requires_grad_();
  auto v = at::randn({B, Hkv, T, D}).requires_grad_();
  auto biased = trainable(random_prefix(2, Hkv, 4, D, /*biased=*/true));
  auto plain = trainable(random_prefix(2, Hkv, 3, D));
  std::vector<PrefixList> rows = {{plain}, {plain, biased}, {}, {plain}, {biased}};
  auto mask = ops::causal_mask(past, S, T, at::TensorOptions().dtype(at::kFloat));
  auto out = ops::attention_padded_prefixes(q, k, v, mask, rows, /*layer=*/1);
  std::vector<at::Tensor> expected_rows;
  for (int64_t b = 0; b < B; ++b) {
    expected_rows.push_back(reference_attention(q[b], k[b].narrow(1, 0, past[b] + S), v[b].narrow(1, 0, past[b] + S),
                                                {past[b]}, rows[b], 1));
  }
  auto expected = at::stack(expected_rows);
  EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-5));
  auto weight = at::randn({B, H, S, D});
  auto grads = [&](const at::Tensor& o) {
    std::vector<at::Tensor> inputs{q, k, v, plain->keys[1], plain->values[1], biased->keys[1], biased->values[1]};
    return torch::autograd::grad({(o * weight).sum()}, inputs, {}, /*retain_graph=*/true, false,
                                 /*allow_unused=*/true);
  };
  auto got = grads(out), want = grads(expected);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << "input " << i;
    // The own keys past a row's past + S get no gradient in the reference (it never reads them).
    auto reference = want[i].defined() ? want[i] : at::zeros_like(got[i]);
    EXPECT_TRUE(at::allclose(got[i], reference, 1e-4, 1e-5)) << "input " << i;
  }
}

TEST(AttentionTest, GradientReachesPrefix) {
  at::manual_seed(2);
  auto p = std::make_shared<KVPrefix>();
  p->keys.push_back(at::randn({1, 3, 4}).requires_grad_());
  p->values.push_back(at::randn({1, 3, 4}).requires_grad_());
  auto q = at::randn({1, 2, 2, 4}), k = at::randn({1, 1, 2, 4}), v = at::randn({1, 1, 2, 4});
  auto mask = ops::causal_mask({0}, 2, 2, at::TensorOptions().dtype(at::kFloat));
  auto out = ops::attention(q, k, v, mask, {{p}}, 0, true);
  out.sum().backward();
  ASSERT_TRUE(p->keys[0].grad().defined());
  EXPECT_GT(p->values[0].grad().abs().sum().item<float>(), 0);
}

TEST(SparseCrossEntropyTest, LogsumexpAndGradientMatchAten) {
  // 1,000 words: a tail past the last 16 lanes; ids repeat in row 0, as scatter_add sums them.
  auto z = at::randn({9, 1000}) * 4;
  auto ids = at::randint(1000, {9, 5}, at::kLong);
  ids.index_put_({0, 1}, ids[0][0].item<int64_t>());
  auto coef = at::rand({9, 5});
  auto mass = at::rand({9}) + 0.5;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto zd = z.to(dtype);
    const auto zf = zd.to(at::kFloat);
    auto lse = ops::logsumexp_rows_cpu(zd);
    EXPECT_TRUE(at::allclose(lse, at::logsumexp(zf, -1), 1e-5, 1e-5)) << (lse - at::logsumexp(zf, -1)).abs().max();
    auto expected = (zf - lse.unsqueeze(1)).exp() * mass.unsqueeze(1);
    expected.scatter_add_(1, ids, -coef);
    auto got = ops::softmax_grad_cpu(zd, lse, mass, ids, coef);
    ASSERT_EQ(got.scalar_type(), dtype);
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
    EXPECT_TRUE(at::allclose(got.to(at::kFloat), expected, tol, 1e-6)) << (got.to(at::kFloat) - expected).abs().max();
  }
  auto outside = ids.clone();
  outside.index_put_({2, 3}, 1000);
  EXPECT_THROW(ops::softmax_grad_cpu(z, ops::logsumexp_rows_cpu(z), mass, outside, coef), c10::Error);
}

TEST(RopeTest, FusedSplitHeadsMatchesApplyRopeForwardAndGradient) {
  auto c = rope_config("default");
  const int64_t B = 2, S = 7, heads = 4, kv = 2, dim = 16;
  auto inv = ops::rope_inv_freq(c);
  auto positions = at::arange(S, at::kLong).view({1, S}) + at::tensor({3L, 40L}, at::kLong).view({B, 1});
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto [cos, sin] = ops::rope_cos_sin(inv, positions, dtype);  // [B, 1, S, D]
    auto qkv = at::randn({B, S, (heads + 2 * kv) * dim}).to(dtype).requires_grad_(true);
    auto [q, k, v] = ops::rope_split_heads_cpu(qkv, cos, sin, heads, kv);
    EXPECT_TRUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous());
    // The reference: the heads' views of qkv through apply_rope, in float64.
    auto ref = qkv.detach().to(at::kDouble).requires_grad_(true);
    auto c64 = cos.to(at::kDouble), s64 = sin.to(at::kDouble);
    auto rq = ops::apply_rope(ref.narrow(2, 0, heads * dim).view({B, S, heads, dim}).transpose(1, 2), c64, s64);
    auto rk = ops::apply_rope(ref.narrow(2, heads * dim, kv * dim).view({B, S, kv, dim}).transpose(1, 2), c64, s64);
    auto rv = ref.narrow(2, (heads + kv) * dim, kv * dim).view({B, S, kv, dim}).transpose(1, 2);
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
    for (auto [got, want] : {std::pair{q, rq}, std::pair{k, rk}, std::pair{v, rv}}) {
      EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, tol, tol)) << (got.to(at::kDouble) - want).abs().max();
    }
    auto gq = at::randn(q.sizes()), gk = at::randn(k.sizes()), gv = at::randn(v.sizes());
    auto dqkv = torch::autograd::grad({q, k, v}, {qkv}, {gq.to(dtype), gk.to(dtype), gv.to(dtype)}, /*retain_graph=*/true)[0];
    auto want = torch::autograd::grad({rq, rk, rv}, {ref},
                                      {gq.to(dtype).to(at::kDouble), gk.to(dtype).to(at::kDouble),
                                       gv.to(dtype).to(at::kDouble)})[0];
    EXPECT_TRUE(at::allclose(dqkv.to(at::kDouble), want, tol, tol)) << (dqkv.to(at::kDouble) - want).abs().max();
    // An output that takes no part in the loss gives no gradient to its part of qkv.
    auto only_q = torch::autograd::grad({q}, {qkv}, {gq.to(dtype)})[0];
    EXPECT_TRUE(at::equal(only_q.narrow(2, heads * dim, 2 * kv * dim), at::zeros({B, S, 2 * kv * dim}, dtype)));
  }
}

TEST(WeightedRowsTest, MergeAndItsBackwardMatchAten) {
  // 70 elements a row: a tail past the last 16 lanes.
  auto a = at::randn({2, 3, 5, 70}), b = at::randn({2, 3, 5, 70});
  auto wa = at::rand({2, 3, 5}), wb = at::rand({2, 3, 5});
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto ad = a.to(dtype), bd = b.to(dtype);
    const auto want = ad.to(at::kFloat) * wa.unsqueeze(-1) + bd.to(at::kFloat) * wb.unsqueeze(-1);
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
    auto got = ops::weighted_row_sum_cpu(ad, wa, bd, wb);
    ASSERT_EQ(got.scalar_type(), dtype);
    EXPECT_TRUE(at::allclose(got.to(at::kFloat), want, tol, 1e-6)) << (got.to(at::kFloat) - want).abs().max();
    auto [x_a, x_b] = ops::scaled_rows_cpu(ad, wa, wb);
    EXPECT_TRUE(at::allclose(x_a.to(at::kFloat), ad.to(at::kFloat) * wa.unsqueeze(-1), tol, 1e-6));
    EXPECT_TRUE(at::allclose(x_b.to(at::kFloat), ad.to(at::kFloat) * wb.unsqueeze(-1), tol, 1e-6));
  }
  EXPECT_THROW(ops::weighted_row_sum_cpu(a, wa.narrow(2, 0, 4), b, wb), c10::Error);
}
