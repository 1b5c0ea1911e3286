// The block-quantized kernels of quantized.h with float32 activations, and the entry point that
// picks them or the int8 ones (quantized_int8.cpp).
#include "model/avx2.h"
#include "model/quantized.h"
#include "model/quantized_int8.h"
#include "model/spin_pool.h"

#include "cartridges/model.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace cartridges {

BlockFormat parse_block_format(const std::string& name) {
  if (name == "Q4_0") return BlockFormat::kQ4_0;
  if (name == "Q4_1") return BlockFormat::kQ4_1;
  if (name == "Q8_0") return BlockFormat::kQ8_0;
  TORCH_CHECK(false, "unsupported quantized block format '", name, "' (Q4_0, Q4_1, Q8_0)");
}

int64_t block_bytes(BlockFormat format) {
  switch (format) {
    case BlockFormat::kQ4_0: return 2 + 16;      // d (f16), 32 x 4-bit
    case BlockFormat::kQ4_1: return 2 + 2 + 16;  // d, m (f16), 32 x 4-bit
    case BlockFormat::kQ8_0: return 2 + 32;      // d (f16), 32 x int8
  }
  TORCH_INTERNAL_ASSERT(false);
}

namespace {

constexpr int kBlock = 32;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Scalar dequantization of one block into out[32] (reference, and fallback without AVX2).
// ggml's layout: a 4-bit block stores element j in the low nibble of byte j and element
// j + 16 in its high nibble.
void dequantize_block(BlockFormat format, const uint8_t* block, float* out) {
  const float d = half_at(block);
  switch (format) {
    case BlockFormat::kQ4_0:
      for (int j = 0; j < 16; ++j) {
        out[j] = d * static_cast<float>((block[2 + j] & 0x0F) - 8);
        out[j + 16] = d * static_cast<float>((block[2 + j] >> 4) - 8);
      }
      return;
    case BlockFormat::kQ4_1: {
      const float m = half_at(block + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * static_cast<float>(block[4 + j] & 0x0F) + m;
        out[j + 16] = d * static_cast<float>(block[4 + j] >> 4) + m;
      }
      return;
    }
    case BlockFormat::kQ8_0:
      for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
      return;
  }
}

void scalar_rows(BlockFormat format, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x,
                 int64_t rows, int64_t in, float* y, int64_t out, int64_t n_begin, int64_t n_end) {
  const int64_t bb = block_bytes(format);
  float tmp[kBlock];
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t r = 0; r < rows; ++r) y[r * out + n] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_block(format, w + n * row_bytes + b * bb, tmp);
      for (int64_t r = 0; r < rows; ++r) {
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += x[r * in + b * kBlock + j] * tmp[j];
        y[r * out + n] += s;
      }
    }
  }
}

// ---- AVX2 kernel ------------------------------------------------------------------------

#define CARTRIDGES_AVX2 __attribute__((target("avx2,fma,f16c")))

CARTRIDGES_AVX2 inline float half_at_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Dequantizes one block into four vectors of eight weights (elements 0-7, 8-15, 16-23, 24-31).
template <BlockFormat F>
CARTRIDGES_AVX2 inline void load_block(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at_f16c(block));
  if constexpr (F == BlockFormat::kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const int offset = F == BlockFormat::kQ4_1 ? 4 : 2;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + offset));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i parts[2] = {lo, hi};
    for (int i = 0; i < 4; ++i) {
      __m128i half = parts[i / 2];
      if (i % 2) half = _mm_srli_si128(half, 8);
      __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half));
      if constexpr (F == BlockFormat::kQ4_0) {
        w[i] = _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(8.f)));
      } else {
        // d*q is exact in float32, so the fused multiply-add rounds like d*q + m does.
        w[i] = _mm256_fmadd_ps(d, q, _mm256_set1_ps(half_at_f16c(block + 2)));
      }
    }
  }
}

template <BlockFormat F, int R>
CARTRIDGES_AVX2 void avx2_rows(const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t in,
                               float* y, int64_t out, int64_t n_begin, int64_t n_end) {
  constexpr int64_t bb = F == BlockFormat::kQ4_0 ? 18 : F == BlockFormat::kQ4_1 ? 20 : 34;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 wv[4];
      load_block<F>(row + b * bb, wv);
      const float* xb = x + b * kBlock;
      for (int r = 0; r < R; ++r) {
        const float* xr = xb + r * in;
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), wv[0], acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), wv[1], acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), wv[2], acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), wv[3], acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * out + n] = horizontal_sum(acc[r]);
  }
}

using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t);

template <BlockFormat F>
RowsFn pick_rows(int64_t rows) {
  static constexpr RowsFn table[kQuantizedRowGroup] = {avx2_rows<F, 1>, avx2_rows<F, 2>, avx2_rows<F, 3>,
                                                      avx2_rows<F, 4>, avx2_rows<F, 5>, avx2_rows<F, 6>,
                                                      avx2_rows<F, 7>, avx2_rows<F, 8>};
  return table[rows - 1];
}

RowsFn avx2_kernel(BlockFormat format, int64_t rows) {
  switch (format) {
    case BlockFormat::kQ4_0: return pick_rows<BlockFormat::kQ4_0>(rows);
    case BlockFormat::kQ4_1: return pick_rows<BlockFormat::kQ4_1>(rows);
    case BlockFormat::kQ8_0: return pick_rows<BlockFormat::kQ8_0>(rows);
  }
  TORCH_INTERNAL_ASSERT(false);
}

// y [rows, out] = x [rows, in] @ W^T with float32 activations (at most kMaxQuantizedRows rows).
void float32_linear(const float* x, int64_t rows, const QuantizedMatrix& w, float* y) {
  const int64_t in = w.in_features, out = w.out_features(), blocks = in / kBlock;
  const uint8_t* wp = w.data.data_ptr<uint8_t>();
  const int64_t row_bytes = w.data.size(1);
  const bool avx2 = cpu_has_avx2();
  // Output features are independent: split them across threads in chunks that keep each
  // thread streaming through whole rows of weights. Within a chunk, a tile of weight rows
  // (a few KiB, in L1/L2) serves every group of input rows before the next tile is read.
  constexpr int64_t kTile = 16;
  parallel_for(0, out, /*grain_size=*/64, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += kTile) {
      const int64_t tile_end = std::min(tile + kTile, end);
      for (int64_t r0 = 0; r0 < rows; r0 += kQuantizedRowGroup) {
        const int64_t group = std::min(kQuantizedRowGroup, rows - r0);
        if (avx2) {
          avx2_kernel(w.format, group)(wp, row_bytes, blocks, x + r0 * in, in, y + r0 * out, out, tile, tile_end);
        } else {
          scalar_rows(w.format, wp, row_bytes, blocks, x + r0 * in, group, in, y + r0 * out, out, tile, tile_end);
        }
      }
    }
  });
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const QuantizedMatrix& w, ActivationPrecision precision) {
  RECORD_FUNCTION("cartridges::quantized_linear", std::vector<c10::IValue>());  // named in profiles
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "quantized_linear: x must be float32 on CPU");
  TORCH_CHECK(x.size(-1) == w.in_features, "quantized_linear: x has ", x.size(-1), " features, weight takes ",
              w.in_features);
  const int64_t in = w.in_features, out = w.out_features();
  auto flat = x.reshape({-1, in}).contiguous();
  const int64_t rows = flat.size(0);
  TORCH_CHECK(rows >= 1 && rows <= max_quantized_rows(precision), "quantized_linear: ", rows, " rows, at most ",
              max_quantized_rows(precision));
  auto y = at::empty({rows, out}, flat.options());
  const float* xp = flat.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (precision == ActivationPrecision::kInt8) {
    int8_linear(xp, rows, w, yp);
  } else {
    float32_linear(xp, rows, w, yp);
  }
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}

at::Tensor dequantize(const QuantizedMatrix& w) {
  const int64_t out = w.out_features(), blocks = w.in_features / kBlock, bb = block_bytes(w.format);
  auto result = at::empty({out, w.in_features}, at::kFloat);
  float* rp = result.data_ptr<float>();
  const uint8_t* wp = w.data.data_ptr<uint8_t>();
  parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block(w.format, wp + n * w.data.size(1) + b * bb, rp + n * w.in_features + b * kBlock);
      }
    }
  });
  return result;
}

at::Tensor dequantize_weight(const QuantizedWeight& weight, int64_t in_features) {
  const BlockFormat format = parse_block_format(weight.format);
  TORCH_CHECK(weight.data.dim() == 2 && weight.data.scalar_type() == at::kByte && weight.data.device().is_cpu(),
              "quantized weight data must be uint8 [rows, row bytes] on the CPU");
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0, "in_features must be a positive multiple of ", kBlock);
  TORCH_CHECK(weight.data.size(1) == in_features / kBlock * block_bytes(format), "a ", weight.format, " row of ",
              in_features, " weights takes ", in_features / kBlock * block_bytes(format), " bytes, not ",
              weight.data.size(1));
  return dequantize(QuantizedMatrix{format, weight.data.contiguous(), in_features});
}

}  // namespace cartridges
