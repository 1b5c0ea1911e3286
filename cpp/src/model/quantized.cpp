// The block-quantized kernels of quantized.h. Longer than 400 lines: each SIMD kernel sits beside
// the scalar code it must equal (the tests compare them), for both arithmetics and three formats.
#include "model/quantized.h"
#include "model/spin_pool.h"

#include "cartridges/model.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
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

CARTRIDGES_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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
    for (int r = 0; r < R; ++r) y[r * out + n] = hsum(acc[r]);
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

// ---- int8 activations ----------------------------------------------------------------------

// Input rows rounded to 8 bits per block of 32: x[j] ~ scale * q[j]. `sums` holds
// scale * sum(q), which a block's offset multiplies (Q4_1's minimum, Q4_0's -8 * d).
struct Int8Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;     // [rows, blocks, 32]
  std::vector<float> scale;  // [rows, blocks]
  std::vector<float> sums;   // [rows, blocks]
  // The same by pair of blocks (b, b+1), for the AVX2 kernels (empty without AVX2): q_pairs
  // [rows, pairs, 64] = x_b[0..15], x_b+1[0..15], x_b[16..31], x_b+1[16..31], the order in which
  // a pair's weights are unpacked; scale_pairs [rows, pairs, 8] = scale_b four times,
  // then scale_b+1 four times; sums_pairs [rows, pairs, 4] = -8 sum_b, sum_b, -8 sum_b+1,
  // sum_b+1 (what Q4_0's d and Q4_1's m multiply). A missing b+1 (an odd count) is zeros.
  int64_t pairs = 0;
  std::vector<int8_t> q_pairs;
  std::vector<float> scale_pairs, sums_pairs;
};

// One block, as llama.cpp's quantize_row_q8_1 rounds it: scale = max|x| / 127,
// q = round-half-even(x * (127 / max|x|)).
void round_block_scalar(const float* x, int8_t* q, float* scale, float* sum) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inverse = amax != 0.f ? 127.f / amax : 0.f;
  int total = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
    total += q[j];
  }
  *scale = amax / 127.f;
  *sum = *scale * static_cast<float>(total);
}

CARTRIDGES_AVX2 void round_block_avx2(const float* x, int8_t* q, float* scale, float* sum) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float top = _mm_cvtss_f32(m);
  const __m256 inverse = _mm256_set1_ps(top != 0.f ? 127.f / top : 0.f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    n[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_hadd_epi32(t, t);
  t = _mm_hadd_epi32(t, t);
  // The packs interleave 128-bit lanes; the permutation puts the 32 values back in order.
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  *scale = top / 127.f;
  *sum = *scale * static_cast<float>(_mm_cvtsi128_si32(t));
}

void arrange_pairs(Int8Rows& r, int64_t rows) {
  r.pairs = (r.blocks + 1) / 2;
  r.q_pairs.assign(rows * r.pairs * 64, 0);
  r.scale_pairs.assign(rows * r.pairs * 8, 0.f);
  r.sums_pairs.assign(rows * r.pairs * 4, 0.f);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t b = 0; b < r.blocks; ++b) {
      const int64_t pair = row * r.pairs + b / 2, side = b % 2, i = row * r.blocks + b;
      const int8_t* q = r.q.data() + i * kBlock;
      std::memcpy(&r.q_pairs[pair * 64 + side * 16], q, 16);
      std::memcpy(&r.q_pairs[pair * 64 + 32 + side * 16], q + 16, 16);
      std::fill_n(&r.scale_pairs[pair * 8 + side * 4], 4, r.scale[i]);
      r.sums_pairs[pair * 4 + side * 2] = -8.f * r.sums[i];
      r.sums_pairs[pair * 4 + side * 2 + 1] = r.sums[i];
    }
  }
}

Int8Rows round_rows(const float* x, int64_t rows, int64_t in, bool avx2) {
  Int8Rows r;
  r.blocks = in / kBlock;
  r.q.resize(rows * in);
  r.scale.resize(rows * r.blocks);
  r.sums.resize(rows * r.blocks);
  const auto round_block = avx2 ? round_block_avx2 : round_block_scalar;
  for (int64_t i = 0; i < rows * r.blocks; ++i) {
    round_block(x + i * kBlock, r.q.data() + i * kBlock, &r.scale[i], &r.sums[i]);
  }
  if (avx2) arrange_pairs(r, rows);  // the AVX2 kernels' layout
  return r;
}

// Integer dot product of one weight block with one block of activations, before scales.
// 4-bit: the unsigned nibbles (0-15) times the int8 activations; the offset is added apart.
int block_dot_scalar(BlockFormat format, const uint8_t* block, const int8_t* q) {
  int total = 0;
  if (format == BlockFormat::kQ8_0) {
    for (int j = 0; j < kBlock; ++j) total += static_cast<int8_t>(block[2 + j]) * q[j];
    return total;
  }
  const uint8_t* nibbles = block + (format == BlockFormat::kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) total += (nibbles[j] & 0x0F) * q[j] + (nibbles[j] >> 4) * q[j + 16];
  return total;
}

// A block's offset per unit of activation sum: Q4_1's minimum m, Q4_0's -8 d, none for Q8_0.
float block_offset_scalar(BlockFormat format, const uint8_t* block) {
  if (format == BlockFormat::kQ4_1) return half_at(block + 2);
  if (format == BlockFormat::kQ4_0) return -8.f * half_at(block);
  return 0.f;
}

void int8_scalar_rows(BlockFormat format, const uint8_t* w, int64_t row_bytes, const Int8Rows& x, int64_t r0,
                      int64_t rows, float* y, int64_t out, int64_t n_begin, int64_t n_end) {
  const int64_t bb = block_bytes(format);
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t r = r0; r < r0 + rows; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* block = w + n * row_bytes + b * bb;
        const int64_t i = r * x.blocks + b;
        total += half_at(block) * x.scale[i] * static_cast<float>(block_dot_scalar(format, block, &x.q[i * kBlock])) +
                 block_offset_scalar(format, block) * x.sums[i];
      }
      y[r * out + n] = total;
    }
  }
}

// ---- two blocks at a time ------------------------------------------------------------------

// R (<= 8) rows against weight rows [n_begin, n_end), two blocks per step: the weights of
// blocks b and b+1 side by side in two vectors (elements 0-15 of each, then 16-31; a 4-bit
// pair's low and high nibbles), so one unpacking serves 64 weights, and the integer dots land
// in eight int32 lanes, four per block, that are scaled in place (d * the activations' scale,
// per block) and summed into eight float lanes: no reduction inside the row, the block's
// scales in vectors (llama.cpp's way, two blocks wide). The offsets (Q4_0's -8 d, Q4_1's m,
// times the activations' sums) go into four lanes of their own. Every R runs the same code per
// row, so a row's result does not depend on how many rows share its step; VNNI's dpbusd and
// AVX2's maddubs + madd give the same exact integers, so neither does it depend on the CPU's
// VNNI.
#define CARTRIDGES_VNNI __attribute__((target("avx512vnni,avx512vl,avx2,fma,f16c")))

CARTRIDGES_AVX2 inline __m128i load_16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The exact integer dots of a pair of blocks with their activations: lanes 0-3 block b, 4-7
// block b+1. Unsigned weights (4-bit nibbles) multiply the activations as they are; signed ones
// (Q8_0) give maddubs / dpbusd their magnitude and move their sign onto the activations.
template <bool Signed>
CARTRIDGES_AVX2 inline void pair_operands(__m256i& lo, __m256i& hi, const int8_t* x, __m256i& x_lo, __m256i& x_hi) {
  x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
  if constexpr (Signed) {
    x_lo = _mm256_sign_epi8(x_lo, lo);
    x_hi = _mm256_sign_epi8(x_hi, hi);
    lo = _mm256_sign_epi8(lo, lo);
    hi = _mm256_sign_epi8(hi, hi);
  }
}

template <bool Signed>
CARTRIDGES_AVX2 inline __m256i pair_dot_avx2(__m256i lo, __m256i hi, const int8_t* x) {
  __m256i x_lo, x_hi;
  pair_operands<Signed>(lo, hi, x, x_lo, x_hi);
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), ones),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), ones));
}

template <bool Signed>
CARTRIDGES_VNNI inline __m256i pair_dot_vnni(__m256i lo, __m256i hi, const int8_t* x) {
  __m256i x_lo, x_hi;
  pair_operands<Signed>(lo, hi, x, x_lo, x_hi);
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x_lo), hi, x_hi);
}

// One definition for both targets: GCC compiles a function for one target only, and the
// intrinsics must inline into a function of their target.
#define CARTRIDGES_PAIR_ROWS(NAME, TARGET, DOT) \
  template <BlockFormat F, int R>                                                                                           \
  TARGET void NAME(const uint8_t* w, int64_t row_bytes, const Int8Rows& x, int64_t r0, float* y, int64_t out,               \
                   int64_t n_begin, int64_t n_end)                                                                          \
{                                                                                                                           \
  constexpr int64_t bb = F == BlockFormat::kQ4_0 ? 18 : F == BlockFormat::kQ4_1 ? 20 : 34;                                \
  constexpr int64_t values = F == BlockFormat::kQ4_1 ? 4 : 2; /* where the weights start in a block */                   \
  const int64_t blocks = x.blocks, pairs = x.pairs;                                                                         \
  const int8_t* xq = x.q_pairs.data() + r0 * pairs * 64;                                                                    \
  const float* xs = x.scale_pairs.data() + r0 * pairs * 8;                                                                  \
  const float* xsum = x.sums_pairs.data() + r0 * pairs * 4;                                                                 \
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);                                                                       \
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);  /* d_b to lanes 0-3, d_b+1 to 4-7 */                   \
  /* Q4_0, Q8_0: the half after d is weights, not a number: keep d's bits only. Q4_1: m is the offset's weight. */          \
  const __m128i scale_bits = _mm_set1_epi32(F == BlockFormat::kQ4_1 ? -1 : 0x0000FFFF);                                     \
  const __m128 offset_lanes = _mm_castsi128_ps(F == BlockFormat::kQ4_0 ? _mm_setr_epi32(-1, 0, -1, 0)                       \
                                                                      : _mm_setr_epi32(0, -1, 0, -1));                      \
  for (int64_t n = n_begin; n < n_end; ++n) {                                                                               \
    const uint8_t* row = w + n * row_bytes;                                                                                 \
    __m256 acc[R];                                                                                                          \
    __m128 offset[R];                                                                                                       \
    for (int r = 0; r < R; ++r) {                                                                                           \
      acc[r] = _mm256_setzero_ps();                                                                                         \
      offset[r] = _mm_setzero_ps();                                                                                         \
    }                                                                                                                       \
    for (int64_t p = 0; p < pairs; ++p) {                                                                                   \
      const uint8_t* first = row + 2 * p * bb;                                                                              \
      const bool two = 2 * p + 1 < blocks;                                                                                  \
      const uint8_t* second = first + bb;                                                                                   \
      __m256i lo, hi;                                                                                                       \
      if constexpr (F == BlockFormat::kQ8_0) {                                                                              \
        lo = _mm256_set_m128i(two ? load_16(second + values) : _mm_setzero_si128(), load_16(first + values));               \
        hi = _mm256_set_m128i(two ? load_16(second + values + 16) : _mm_setzero_si128(), load_16(first + values + 16));     \
      } else {                                                                                                              \
        const __m256i v = _mm256_set_m128i(two ? load_16(second + values) : _mm_setzero_si128(), load_16(first + values));  \
        lo = _mm256_and_si256(v, low_nibbles);                                                                              \
        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);                                                        \
      }                                                                                                                     \
      uint32_t head0, head1 = 0;                                                                                            \
      std::memcpy(&head0, first, 4);                                                                                        \
      if (two) std::memcpy(&head1, second, 4);                                                                              \
      /* [d_b, m_b, d_b+1, m_b+1] (Q4_0: [d_b, 0, d_b+1, 0]) */                                                             \
      const __m128 heads = _mm_cvtph_ps(_mm_and_si128(_mm_setr_epi32(head0, head1, 0, 0), scale_bits));                     \
      const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(heads), spread);                                     \
      const __m128 offset_weights = _mm_and_ps(heads, offset_lanes);                                                        \
      for (int r = 0; r < R; ++r) {                                                                                         \
        const int64_t i = r * pairs + p;                                                                                    \
        const __m256i dot = DOT<F == BlockFormat::kQ8_0>(lo, hi, xq + i * 64);                                              \
        const __m256 scales = _mm256_mul_ps(d, _mm256_loadu_ps(xs + i * 8));                                                \
        acc[r] = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(dot), acc[r]);                                                  \
        if constexpr (F != BlockFormat::kQ8_0) {                                                                            \
          offset[r] = _mm_fmadd_ps(offset_weights, _mm_loadu_ps(xsum + i * 4), offset[r]);                                  \
        }                                                                                                                   \
      }                                                                                                                     \
    }                                                                                                                       \
    for (int r = 0; r < R; ++r) {                                                                                           \
      __m128 o = _mm_add_ps(offset[r], _mm_movehl_ps(offset[r], offset[r]));  /* lanes 0+2, 1+3 */                          \
      o = _mm_add_ss(o, _mm_movehdup_ps(o));                                                                                \
      y[(r0 + r) * out + n] = hsum(acc[r]) + _mm_cvtss_f32(o);                                                              \
    }                                                                                                                       \
  }                                                                                                                         \
}

CARTRIDGES_PAIR_ROWS(int8_pair_rows_avx2, CARTRIDGES_AVX2, pair_dot_avx2)
CARTRIDGES_PAIR_ROWS(int8_pair_rows_vnni, CARTRIDGES_VNNI, pair_dot_vnni)
#undef CARTRIDGES_PAIR_ROWS

using Int8RowsFn = void (*)(const uint8_t*, int64_t, const Int8Rows&, int64_t, float*, int64_t, int64_t, int64_t);

template <BlockFormat F>
Int8RowsFn pick_pair_rows(int64_t rows, bool vnni) {
  static constexpr Int8RowsFn avx2[kQuantizedRowGroup] = {
      int8_pair_rows_avx2<F, 1>, int8_pair_rows_avx2<F, 2>, int8_pair_rows_avx2<F, 3>, int8_pair_rows_avx2<F, 4>,
      int8_pair_rows_avx2<F, 5>, int8_pair_rows_avx2<F, 6>, int8_pair_rows_avx2<F, 7>, int8_pair_rows_avx2<F, 8>};
  static constexpr Int8RowsFn with_vnni[kQuantizedRowGroup] = {
      int8_pair_rows_vnni<F, 1>, int8_pair_rows_vnni<F, 2>, int8_pair_rows_vnni<F, 3>, int8_pair_rows_vnni<F, 4>,
      int8_pair_rows_vnni<F, 5>, int8_pair_rows_vnni<F, 6>, int8_pair_rows_vnni<F, 7>, int8_pair_rows_vnni<F, 8>};
  return (vnni ? with_vnni : avx2)[rows - 1];
}

// CARTRIDGES_NO_VNNI=1 runs the AVX2 kernel on a CPU with VNNI: to measure what CPUs without it get.
std::atomic<bool> vnni_allowed{std::getenv("CARTRIDGES_NO_VNNI") == nullptr};

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return yes && vnni_allowed.load(std::memory_order_relaxed);
}

Int8RowsFn int8_avx2_kernel(BlockFormat format, int64_t rows) {
  switch (format) {
    case BlockFormat::kQ4_0: return pick_pair_rows<BlockFormat::kQ4_0>(rows, has_vnni());
    case BlockFormat::kQ4_1: return pick_pair_rows<BlockFormat::kQ4_1>(rows, has_vnni());
    case BlockFormat::kQ8_0: return pick_pair_rows<BlockFormat::kQ8_0>(rows, has_vnni());
  }
  TORCH_INTERNAL_ASSERT(false);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const QuantizedMatrix& w, ActivationPrecision precision) {
  RECORD_FUNCTION("cartridges::quantized_linear", std::vector<c10::IValue>());  // named in profiles
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "quantized_linear: x must be float32 on CPU");
  TORCH_CHECK(x.size(-1) == w.in_features, "quantized_linear: x has ", x.size(-1), " features, weight takes ",
              w.in_features);
  const int64_t in = w.in_features, out = w.out_features(), blocks = in / kBlock;
  auto flat = x.reshape({-1, in}).contiguous();
  const int64_t rows = flat.size(0);
  TORCH_CHECK(rows >= 1 && rows <= max_quantized_rows(precision), "quantized_linear: ", rows, " rows, at most ",
              max_quantized_rows(precision));
  auto y = at::empty({rows, out}, flat.options());
  const uint8_t* wp = w.data.data_ptr<uint8_t>();
  const int64_t row_bytes = w.data.size(1);
  const float* xp = flat.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool avx2 = has_avx2();
  const bool int8 = precision == ActivationPrecision::kInt8;
  // Rounded once, before the threads split the weights (a few microseconds).
  const Int8Rows xq = int8 ? round_rows(xp, rows, in, avx2) : Int8Rows{};
  // Output features are independent: split them across threads in chunks that keep each
  // thread streaming through whole rows of weights. Within a chunk, a tile of weight rows
  // (a few KiB, in L1/L2) serves every group of input rows before the next tile is read.
  // Many input rows (a prompt) go 64 at a time, so that their activations stay in cache
  // while every tile passes them.
  constexpr int64_t kTile = 16, kRowChunk = 64;
  auto multiply = [&](int64_t first_row, int64_t last_row, int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += kTile) {
      const int64_t tile_end = std::min(tile + kTile, end);
      for (int64_t r0 = first_row; r0 < last_row; r0 += kQuantizedRowGroup) {
        const int64_t group = std::min(kQuantizedRowGroup, last_row - r0);
        if (int8 && avx2) {
          int8_avx2_kernel(w.format, group)(wp, row_bytes, xq, r0, yp, out, tile, tile_end);
        } else if (int8) {
          int8_scalar_rows(w.format, wp, row_bytes, xq, r0, group, yp, out, tile, tile_end);
        } else if (avx2) {
          avx2_kernel(w.format, group)(wp, row_bytes, blocks, xp + r0 * in, in, yp + r0 * out, out, tile, tile_end);
        } else {
          scalar_rows(w.format, wp, row_bytes, blocks, xp + r0 * in, group, in, yp + r0 * out, out, tile, tile_end);
        }
      }
    }
  };
  for (int64_t first = 0; first < rows; first += kRowChunk) {
    const int64_t last = std::min(first + kRowChunk, rows);
    parallel_for(0, out, /*grain_size=*/64, [&](int64_t begin, int64_t end) { multiply(first, last, begin, end); });
  }
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}

bool allow_vnni_for_testing(bool allowed) { return vnni_allowed.exchange(allowed); }

at::Tensor round_activations_int8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.size(-1) % kBlock == 0,
              "round_activations_int8: x must be float32 on CPU with a multiple of 32 features");
  auto flat = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t rows = flat.size(0), in = flat.size(1);
  const auto rounded = round_rows(flat.data_ptr<float>(), rows, in, has_avx2());
  auto result = at::empty_like(flat);
  float* rp = result.data_ptr<float>();
  for (int64_t i = 0; i < rows * in; ++i) rp[i] = rounded.scale[i / kBlock] * static_cast<float>(rounded.q[i]);
  return result.view(x.sizes());
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
