// The block-quantized CPU kernel against at::linear on the dequantized weights.
#include <gtest/gtest.h>

#include "model/quantized.h"
#include "random_quantized.h"

using namespace cartridges;

class QuantizedTest : public ::testing::TestWithParam<BlockFormat> {};

TEST_P(QuantizedTest, MatchesLinearOnDequantizedWeights) {
  at::manual_seed(0);
  auto w = random_quantized_matrix(GetParam(), 200, 96);
  auto dense = dequantize(w);
  ASSERT_TRUE(at::isfinite(dense).all().item<bool>());
  for (int64_t rows = 1; rows <= kMaxQuantizedRows; ++rows) {
    auto x = at::randn({rows, 1, 96});
    auto got = quantized_linear(x, w);
    auto expected = at::linear(x, dense);
    ASSERT_EQ(got.sizes(), expected.sizes());
    // Only the summation order differs: float32 rounding relative to the outputs' scale.
    const double atol = 1e-6 * expected.abs().max().item<double>();
    EXPECT_TRUE(at::allclose(got, expected, 1e-5, atol)) << "rows " << rows << ": max |diff| "
                                                         << (got - expected).abs().max().item<float>();
  }
}

TEST_P(QuantizedTest, Int8ActivationsMatchLinearOnRoundedActivations) {
  at::manual_seed(1);
  auto w = random_quantized_matrix(GetParam(), 200, 96);
  auto dense = dequantize(w);
  for (int64_t rows : std::vector<int64_t>{1, 2, 7, 8, 9, 16, 20, 33, 64, 150}) {
    auto x = at::randn({rows, 96});
    x[0].narrow(0, 32, 32).zero_();  // an all-zero block has scale 0
    auto got = quantized_linear(x, w, ActivationPrecision::kInt8);
    // Integer dot products are exact: only the float scaling and summation order differ.
    auto expected = at::linear(round_activations_int8(x), dense);
    const double atol = 1e-6 * expected.abs().max().item<double>();
    EXPECT_TRUE(at::allclose(got, expected, 1e-5, atol)) << "rows " << rows << ": max |diff| "
                                                         << (got - expected).abs().max().item<float>();
    // And the rounding costs little against float32 activations.
    auto exact = at::linear(x, dense);
    EXPECT_LT((got - exact).abs().max().item<double>(), 0.02 * exact.abs().max().item<double>()) << "rows " << rows;
  }
  EXPECT_THROW(quantized_linear(at::randn({kMaxQuantizedRows + 1, 96}), w), c10::Error);  // float32: GEMM's job
}

TEST_P(QuantizedTest, Int8RowResultsDoNotDependOnTheBatch) {
  // A request's logits must not change with what shares its step: each row, computed alone,
  // in a group of 2-8 and in a chunk past 64 rows, gives bit-identical outputs.
  at::manual_seed(3);
  auto w = random_quantized_matrix(GetParam(), 40, 352);  // 11 blocks; 40 features: two groups of 16 and a half
  auto x = at::randn({70, 352});
  auto all = quantized_linear(x, w, ActivationPrecision::kInt8);
  for (int64_t rows : {1, 2, 3, 5, 8, 9, 16}) {
    auto part = quantized_linear(x.narrow(0, 0, rows), w, ActivationPrecision::kInt8);
    EXPECT_TRUE(at::equal(part, all.narrow(0, 0, rows))) << "rows " << rows;
  }
  for (int64_t r = 0; r < 70; r += 23) {
    EXPECT_TRUE(at::equal(quantized_linear(x.narrow(0, r, 1), w, ActivationPrecision::kInt8), all.narrow(0, r, 1)))
        << "row " << r;
  }
}

TEST_P(QuantizedTest, Int8ProductsSpanningSeveralTilesMatch) {
  // The kernel walks a thread's groups in tiles of up to 256 KiB of weights: a matrix of
  // several tiles (1,100 features, a last group of 12, by 1,024) gives what one tile would,
  // for a row alone, for passes of rows and past a chunk of 64 rows.
  at::manual_seed(6);
  auto w = random_quantized_matrix(GetParam(), 1100, 1024);
  ASSERT_GT(w.int8_weights.nbytes(), 2 * (256 << 10));
  auto dense = dequantize(w);
  auto x = at::randn({70, 1024});
  auto all = quantized_linear(x, w, ActivationPrecision::kInt8);
  auto expected = at::linear(round_activations_int8(x), dense);
  const double atol = 1e-6 * expected.abs().max().item<double>();
  EXPECT_TRUE(at::allclose(all, expected, 1e-5, atol)) << (all - expected).abs().max().item<float>();
  for (int64_t rows : {1, 9, 16}) {
    EXPECT_TRUE(at::equal(quantized_linear(x.narrow(0, 0, rows), w, ActivationPrecision::kInt8),
                          all.narrow(0, 0, rows))) << "rows " << rows;
  }
}

TEST_P(QuantizedTest, Int8ResultsDoNotDependOnVnni) {
  // The AVX-512 VNNI and AVX2 kernels compute the same exact integer dots and scale them alike
  // (Q8_0 as w + 128 less 128 times the activations' sum on AVX-512, as |w| times signed x on AVX2).
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512vnni")) {
    GTEST_SKIP() << "this CPU has no AVX-512 (F, BW, VL, VNNI): only the AVX2 kernel runs";
  }
  // Every pass size of the AVX-512 kernel (1-8 rows), and passes of 8 with a remainder.
  at::manual_seed(4);
  auto w = random_quantized_matrix(GetParam(), 40, 352);
  for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 19}) {
    auto x = at::randn({rows, 352});
    auto with_vnni = quantized_linear(x, w, ActivationPrecision::kInt8);
    const bool before = allow_vnni_for_testing(false);
    auto without = quantized_linear(x, w, ActivationPrecision::kInt8);
    allow_vnni_for_testing(before);
    EXPECT_TRUE(at::equal(with_vnni, without)) << "rows " << rows;
  }
}

TEST_P(QuantizedTest, Int8ResultsDoNotDependOnSimd) {
  // The scalar code (CPUs without AVX2) computes each output as the SIMD kernels do.
  at::manual_seed(5);
  auto w = random_quantized_matrix(GetParam(), 37, 352);  // a last group of 5 features
  auto x = at::randn({6, 352});
  x[2].narrow(0, 64, 32).zero_();  // an all-zero block has scale 0
  auto simd = quantized_linear(x, w, ActivationPrecision::kInt8);
  const bool before = allow_simd_for_testing(false);
  auto scalar = quantized_linear(x, w, ActivationPrecision::kInt8);
  allow_simd_for_testing(before);
  EXPECT_TRUE(at::equal(simd, scalar)) << (simd - scalar).abs().max().item<float>();
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizedTest,
                         ::testing::Values(BlockFormat::kQ4_0, BlockFormat::kQ4_1, BlockFormat::kQ8_0));

TEST(QuantizedFormatTest, RoundsActivationsLikeLlamaCpp) {
  // Per block of 32: scale = max|x| / 127, q = round half to even of x * (127 / max|x|).
  at::manual_seed(2);
  auto x = at::randn({3, 64}) * 3;
  x[1].narrow(0, 0, 32).zero_();
  x[2][5] = 127.f / 2;  // x * 127 / max = 63.5 exactly at max 127: a tie, rounded to even
  x[2][6] = 127.f;
  auto blocks = x.view({3, 2, 32});
  auto top = blocks.abs().amax(-1, /*keepdim=*/true);
  auto inverse = at::where(top != 0, 127.f / top, at::zeros_like(top));
  auto expected = (at::round(blocks * inverse) * (top / 127.f)).view({3, 64});
  auto got = round_activations_int8(x);
  EXPECT_TRUE(at::equal(got, expected)) << (got - expected).abs().max().item<float>();
  EXPECT_FLOAT_EQ(got[2][5].item<float>(), 64.f);
  EXPECT_TRUE(at::equal(got[1].narrow(0, 0, 32), at::zeros({32})));
}

TEST(QuantizedFormatTest, DequantizesKnownBlock) {
  // One Q4_1 block: d = 0.5, m = -1, byte j holds element j (low) and j + 16 (high).
  std::vector<uint8_t> block(20);
  const uint16_t d = c10::Half(0.5f).x, m = c10::Half(-1.f).x;
  std::memcpy(block.data(), &d, 2);
  std::memcpy(block.data() + 2, &m, 2);
  for (int j = 0; j < 16; ++j) block[4 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  auto data = at::from_blob(block.data(), {1, 20}, at::kByte).clone();
  auto dense = dequantize(QuantizedMatrix{BlockFormat::kQ4_1, data, 32});
  for (int j = 0; j < 16; ++j) {
    EXPECT_FLOAT_EQ(dense[0][j].item<float>(), 0.5f * j - 1.f);
    EXPECT_FLOAT_EQ(dense[0][j + 16].item<float>(), 0.5f * (15 - j) - 1.f);
  }
  EXPECT_THROW(parse_block_format("Q5_K"), c10::Error);
}
