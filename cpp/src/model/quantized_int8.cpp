// Int8 activations against block-quantized weights (llama.cpp's arithmetic), laid out for SIMD.
//
// A GGUF matrix stores each output feature's weights as blocks of 32 with their own scale, so
// a kernel that walks it feature by feature must reduce every block's products across a
// vector and scale them one block at a time: most of its instructions are bookkeeping, not
// products. Here the weights are laid out once (add_int8_layout) in groups of 16 output
// features: per group and block, runs of 4 weights of all 16 features side by side (one
// 64-byte cache line per run), and the 16 features' scales. One dot instruction then multiplies
// a run by 4 broadcast activations of a row: AVX-512 VNNI's dpbusd all 16 features at once,
// AVX2's maddubs 8 of them. A block's integers land in one lane per feature, and each lane is
// scaled and accumulated in float32 on its own: no reduction within a vector. A pass takes a
// group and up to 8 rows (AVX-512) or 4 (AVX2): a run's weights are unpacked once for every
// row of the pass.
//
// Every path computes each output the same way: per block, the exact integer dot product, then
// acc = fma(d * scale, dot, acc) and, for 4-bit formats, acc = fma(offset, scale * sum(q), acc)
// (offset: Q4_0's -8 d, Q4_1's minimum m), blocks in order. So AVX-512, AVX2 and the scalar code
// give the same bits, and a row's result does not depend on the rows beside it.
#include "model/quantized_int8.h"

#include "model/spin_pool.h"

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace cartridges {

namespace {

constexpr int kBlock = 32;
// Output features per group of the int8 layout (one 64-byte line per run of 4 weights).
constexpr int64_t kInt8Group = 16;

// Bytes of one group's block in the int8 layout: 16 features x 32 weights, as 4-bit pairs
// (4-bit formats) or bytes (Q8_0).
int64_t group_block_bytes(BlockFormat format) { return format == BlockFormat::kQ8_0 ? 512 : 256; }

float half_bits_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

uint16_t half_bits_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// Input rows rounded to 8 bits per block of 32: x[j] ~ scale * q[j]. `totals` holds sum(q),
// which the AVX-512 kernel takes off Q8_0's shifted dots, and `sums` scale * sum(q), which a
// 4-bit block's offset multiplies.
struct Int8Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;        // [rows, blocks, 32]
  std::vector<float> scale;     // [rows, blocks]
  std::vector<int32_t> totals;  // [rows, blocks]
  std::vector<float> sums;      // [rows, blocks]
};

#define CARTRIDGES_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CARTRIDGES_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// One block, as llama.cpp's quantize_row_q8_1 rounds it: scale = max|x| / 127,
// q = round-half-even(x * (127 / max|x|)).
void round_block_scalar(const float* x, int8_t* q, float* scale, int32_t* total) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inverse = amax != 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
    sum += q[j];
  }
  *scale = amax / 127.f;
  *total = sum;
}

CARTRIDGES_AVX2 void round_block_avx2(const float* x, int8_t* q, float* scale, int32_t* total) {
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
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_hadd_epi32(t, t);
  t = _mm_hadd_epi32(t, t);
  // The packs interleave 128-bit lanes; the permutation puts the 32 values back in order.
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  *scale = top / 127.f;
  *total = _mm_cvtsi128_si32(t);
}

Int8Rows round_rows(const float* x, int64_t rows, int64_t in, bool avx2) {
  Int8Rows r;
  r.blocks = in / kBlock;
  r.q.resize(rows * in);
  r.scale.resize(rows * r.blocks);
  r.totals.resize(rows * r.blocks);
  r.sums.resize(rows * r.blocks);
  const auto round_block = avx2 ? round_block_avx2 : round_block_scalar;
  for (int64_t i = 0; i < rows * r.blocks; ++i) {
    round_block(x + i * kBlock, r.q.data() + i * kBlock, &r.scale[i], &r.totals[i]);
    r.sums[i] = r.scale[i] * static_cast<float>(r.totals[i]);
  }
  return r;
}

// ---- the layout --------------------------------------------------------------------------

// One block's weights as bytes: 4-bit values 0-15, or Q8_0's signed q; its scale d and the
// weight of the activations' sum (Q4_0: -8 d, Q4_1: m, Q8_0: none).
void unpack_block(BlockFormat format, const uint8_t* block, uint8_t* q, uint16_t* d, uint16_t* offset) {
  *d = half_bits_at(block);
  switch (format) {
    case BlockFormat::kQ8_0:
      std::memcpy(q, block + 2, kBlock);
      *offset = 0;
      return;
    case BlockFormat::kQ4_0:
    case BlockFormat::kQ4_1: {
      const uint8_t* nibbles = block + (format == BlockFormat::kQ4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        q[j] = nibbles[j] & 0x0F;  // ggml: element j in byte j's low nibble, j + 16 in its high one
        q[j + 16] = nibbles[j] >> 4;
      }
      // -8 d is exact in float16 (a power of two times d).
      *offset = format == BlockFormat::kQ4_1 ? half_bits_at(block + 2)
                                             : c10::Half(-8.f * half_bits_to_float(*d)).x;
      return;
    }
  }
}

// `w`'s int8 layout (QuantizedMatrix::int8_weights and int8_scales) from its GGUF blocks.
void add_int8_layout(QuantizedMatrix& w) {
  const int64_t out = w.out_features(), blocks = w.in_features / kBlock;
  const int64_t groups = (out + kInt8Group - 1) / kInt8Group;
  const int64_t bb = block_bytes(w.format), gb = group_block_bytes(w.format), row_bytes = w.data.size(1);
  // Features past the last whole group are zeros (d = 0): they compute 0 and are never stored.
  auto weights = at::zeros({groups, blocks, gb}, at::kByte);
  auto scales = at::zeros({groups, blocks, 2, kInt8Group}, at::kHalf);
  uint8_t* wp = weights.data_ptr<uint8_t>();
  auto* sp = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  const uint8_t* src = w.data.data_ptr<uint8_t>();
  const bool eight_bit = w.format == BlockFormat::kQ8_0;
  parallel_for(0, out, 256, [&](int64_t begin, int64_t end) {
    uint8_t q[kBlock];
    for (int64_t n = begin; n < end; ++n) {
      const int64_t g = n / kInt8Group, lane = n % kInt8Group;
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t d, offset;
        unpack_block(w.format, src + n * row_bytes + b * bb, q, &d, &offset);
        uint8_t* dst = wp + (g * blocks + b) * gb;
        // Vector j holds, per feature, the 4 weights that the j-th 4 activations multiply:
        // Q8_0 eight vectors (weights 4j..4j+3); 4-bit four, low nibbles 4j..4j+3 and high
        // nibbles 16+4j..16+4j+3.
        for (int j = 0; j < (eight_bit ? 8 : 4); ++j) {
          for (int t = 0; t < 4; ++t) {
            dst[64 * j + 4 * lane + t] = eight_bit ? q[4 * j + t] : q[4 * j + t] | (q[16 + 4 * j + t] << 4);
          }
        }
        uint16_t* s = sp + (g * blocks + b) * 2 * kInt8Group;
        s[lane] = d;
        s[kInt8Group + lane] = offset;
      }
    }
  });
  w.int8_weights = weights;
  w.int8_scales = scales;
}

}  // namespace

QuantizedMatrix quantized_matrix(BlockFormat format, at::Tensor data, int64_t in_features) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.device().is_cpu() && in_features > 0 &&
                  in_features % kBlock == 0 && data.size(1) == in_features / kBlock * block_bytes(format),
              "quantized_matrix: data must be uint8 [out, in / 32 * block bytes] on the CPU");
  QuantizedMatrix w{format, data.contiguous(), in_features, {}, {}};
  add_int8_layout(w);
  return w;
}

namespace {

// ---- SIMD kernels ----------------------------------------------------------------------------

// The integer part of a block on AVX2, one activation run j at a time: `dot` accumulates
// weights w (eight features' 4 weights of run j) times the run's activations broadcast to every
// feature. 4-bit weights (0-15) are unsigned: maddubs takes them as they are, and the pairs'
// sums stay in 16 bits until the block ends (8 runs of at most 2 x 15 x 127 each stay under
// 32,767). Q8_0's signed weights multiply as |w| times x with w's sign (a pair at most
// 2 x 128 x 127), widened to 32 bits at once.
template <bool kEightBit>
CARTRIDGES_AVX2 inline __m256i add_run_avx2(__m256i dot, __m256i w, __m256i x) {
  if constexpr (kEightBit) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  } else {
    return _mm256_add_epi16(dot, _mm256_maddubs_epi16(w, x));
  }
}

template <bool kEightBit>
CARTRIDGES_AVX2 inline __m256i block_dot_avx2(__m256i dot) {
  return kEightBit ? dot : _mm256_madd_epi16(dot, _mm256_set1_epi16(1));
}

// Rows r0..r0+R-1 against groups [g_begin, g_end) on AVX2, a group's 16 features as two vectors
// of 8: per block, each run's weights are unpacked once and serve every row, and each row's
// broadcast activations serve both vectors.
template <BlockFormat F, int R>
CARTRIDGES_AVX2 void group_rows_avx2(const QuantizedMatrix& w, const Int8Rows& x, int64_t r0, float* y, int64_t out,
                                     int64_t g_begin, int64_t g_end) {
  constexpr bool kEightBit = F == BlockFormat::kQ8_0;
  constexpr int64_t gb = kEightBit ? 512 : 256;
  const int64_t blocks = x.blocks;
  const uint8_t* wp = w.int8_weights.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(w.int8_scales.data_ptr<at::Half>());
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t g = g_begin; g < g_end; ++g) {
    // The float accumulators live in memory (touched once per block), so that the registers
    // hold the integer ones and the weights.
    alignas(32) float acc[R][2][8] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = wp + (g * blocks + b) * gb;
      const int8_t* xb[R];
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) {
        xb[r] = x.q.data() + ((r0 + r) * blocks + b) * kBlock;
        dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      }
      // Q8_0: run j's weights at 64 j; 4-bit: runs j and j + 4 as the low and high nibbles at 64 j.
#pragma GCC unroll 1
      for (int j = 0; j < (kEightBit ? 8 : 4); ++j) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j + 32));
        if constexpr (kEightBit) {
          for (int r = 0; r < R; ++r) {
            int32_t run;
            std::memcpy(&run, xb[r] + 4 * j, 4);
            const __m256i xv = _mm256_set1_epi32(run);
            dot[r][0] = add_run_avx2<true>(dot[r][0], v0, xv);
            dot[r][1] = add_run_avx2<true>(dot[r][1], v1, xv);
          }
        } else {
          // The low nibbles (run j), then the high ones (run j + 4): two weight vectors live at a time.
          for (int part = 0; part < 2; ++part) {
            const __m256i w0 = _mm256_and_si256(part ? _mm256_srli_epi16(v0, 4) : v0, low_nibbles);
            const __m256i w1 = _mm256_and_si256(part ? _mm256_srli_epi16(v1, 4) : v1, low_nibbles);
            for (int r = 0; r < R; ++r) {
              int32_t run;
              std::memcpy(&run, xb[r] + 4 * j + 16 * part, 4);
              const __m256i xv = _mm256_set1_epi32(run);
              dot[r][0] = add_run_avx2<false>(dot[r][0], w0, xv);
              dot[r][1] = add_run_avx2<false>(dot[r][1], w1, xv);
            }
          }
        }
      }
      const uint16_t* sb = sp + (g * blocks + b) * 2 * kInt8Group;
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8 * h)));
        const __m256 offset =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + kInt8Group + 8 * h)));
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * blocks + b;
          const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i]));
          __m256 a = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(block_dot_avx2<kEightBit>(dot[r][h])),
                                     _mm256_load_ps(acc[r][h]));
          if constexpr (!kEightBit) a = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.sums[i]), a);
          _mm256_store_ps(acc[r][h], a);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t n = g * kInt8Group + 8 * h, valid = std::min<int64_t>(8, out - n);
      if (valid <= 0) break;
      for (int r = 0; r < R; ++r) std::memcpy(y + (r0 + r) * out + n, acc[r][h], valid * sizeof(float));
    }
  }
}


// AVX-512 with VNNI: a run of a group's 16 features is one 64-byte vector, so one dpbusd
// multiplies it by a row's 4 broadcast activations, and a pass takes up to 8 rows (one integer
// and one float accumulator each, in registers). Q8_0's signed weights go in as w + 128
// (a flipped sign bit), and 128 times the block's sum of activations comes off the integer
// dot: the same exact integer as the AVX2 path's |w| times x with w's sign.
// GCC 12 warns inside its own _mm512_undefined_ps (self-initialized on purpose) wherever
// _mm512_cvtph_ps or _mm512_cvtepi32_ps inline.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <BlockFormat F, int R>
CARTRIDGES_AVX512 void group_rows_avx512(const QuantizedMatrix& w, const Int8Rows& x, int64_t r0, float* y,
                                         int64_t out, int64_t g_begin, int64_t g_end) {
  constexpr bool kEightBit = F == BlockFormat::kQ8_0;
  constexpr int64_t gb = kEightBit ? 512 : 256;
  const int64_t blocks = x.blocks;
  const uint8_t* wp = w.int8_weights.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(w.int8_scales.data_ptr<at::Half>());
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i sign_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = g_begin; g < g_end; ++g) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = wp + (g * blocks + b) * gb;
      const int8_t* xb[R];
      __m512i dot[R];
      for (int r = 0; r < R; ++r) {
        xb[r] = x.q.data() + ((r0 + r) * blocks + b) * kBlock;
        dot[r] = _mm512_setzero_si512();
      }
      // Q8_0: run j's weights at 64 j; 4-bit: runs j and j + 4 as the low and high nibbles at 64 j.
      for (int j = 0; j < (kEightBit ? 8 : 4); ++j) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * j);
        if constexpr (kEightBit) {
          const __m512i shifted = _mm512_xor_si512(v, sign_bits);
          for (int r = 0; r < R; ++r) {
            int32_t run;
            std::memcpy(&run, xb[r] + 4 * j, 4);
            dot[r] = _mm512_dpbusd_epi32(dot[r], shifted, _mm512_set1_epi32(run));
          }
        } else {
          const __m512i low = _mm512_and_si512(v, low_nibbles);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
          for (int r = 0; r < R; ++r) {
            int32_t run_low, run_high;
            std::memcpy(&run_low, xb[r] + 4 * j, 4);
            std::memcpy(&run_high, xb[r] + 4 * j + 16, 4);
            dot[r] = _mm512_dpbusd_epi32(dot[r], low, _mm512_set1_epi32(run_low));
            dot[r] = _mm512_dpbusd_epi32(dot[r], high, _mm512_set1_epi32(run_high));
          }
        }
      }
      const uint16_t* sb = sp + (g * blocks + b) * 2 * kInt8Group;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
      const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kInt8Group)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * blocks + b;
        __m512i exact = dot[r];
        if constexpr (kEightBit) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(128 * x.totals[i]));
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i]));
        acc[r] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(exact), acc[r]);
        if constexpr (!kEightBit) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.sums[i]), acc[r]);
      }
    }
    const int64_t n = g * kInt8Group, valid = std::min<int64_t>(kInt8Group, out - n);
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * out + n, keep, acc[r]);
  }
}
#pragma GCC diagnostic pop

// ---- scalar (no AVX2), from the GGUF blocks themselves ----------------------------------------

void scalar_rows(const QuantizedMatrix& w, const Int8Rows& x, int64_t r0, int64_t rows, float* y, int64_t out,
                 int64_t g_begin, int64_t g_end) {
  const int64_t bb = block_bytes(w.format), row_bytes = w.data.size(1);
  const uint8_t* src = w.data.data_ptr<uint8_t>();
  const bool eight_bit = w.format == BlockFormat::kQ8_0;
  uint8_t q[kBlock];
  for (int64_t n = g_begin * kInt8Group; n < std::min(g_end * kInt8Group, out); ++n) {
    for (int64_t r = r0; r < r0 + rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        uint16_t d, offset;
        unpack_block(w.format, src + n * row_bytes + b * bb, q, &d, &offset);
        const int64_t i = r * x.blocks + b;
        const int8_t* xq = x.q.data() + i * kBlock;
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += (eight_bit ? static_cast<int8_t>(q[j]) : q[j]) * xq[j];
        const float ds = half_bits_to_float(d) * x.scale[i];
        acc = std::fma(ds, static_cast<float>(dot), acc);
        if (!eight_bit) acc = std::fma(half_bits_to_float(offset), x.sums[i], acc);
      }
      y[r * out + n] = acc;
    }
  }
}

using GroupRowsFn = void (*)(const QuantizedMatrix&, const Int8Rows&, int64_t, float*, int64_t, int64_t, int64_t);

// Rows a pass takes. AVX2: each row has two integer accumulators (a group's two vectors), which
// with the two weight vectors, the broadcast activations and the nibble mask fit AVX2's 16
// vector registers at 4 rows; 5 rows were no faster (docs/experiments.md, "Does a pass over both
// halves of a group make the int8 kernel faster?"). AVX-512: one integer and one float
// accumulator a row in its 32 registers.
constexpr int kAvx2RowsPerPass = 4, kAvx512RowsPerPass = 8;

template <BlockFormat F>
GroupRowsFn pick(int64_t rows, bool avx512) {
  static constexpr GroupRowsFn avx2[kAvx2RowsPerPass] = {group_rows_avx2<F, 1>, group_rows_avx2<F, 2>,
                                                         group_rows_avx2<F, 3>, group_rows_avx2<F, 4>};
  static constexpr GroupRowsFn wide[kAvx512RowsPerPass] = {
      group_rows_avx512<F, 1>, group_rows_avx512<F, 2>, group_rows_avx512<F, 3>, group_rows_avx512<F, 4>,
      group_rows_avx512<F, 5>, group_rows_avx512<F, 6>, group_rows_avx512<F, 7>, group_rows_avx512<F, 8>};
  return (avx512 ? wide : avx2)[rows - 1];
}

GroupRowsFn simd_kernel(BlockFormat format, int64_t rows, bool avx512) {
  switch (format) {
    case BlockFormat::kQ4_0: return pick<BlockFormat::kQ4_0>(rows, avx512);
    case BlockFormat::kQ4_1: return pick<BlockFormat::kQ4_1>(rows, avx512);
    case BlockFormat::kQ8_0: return pick<BlockFormat::kQ8_0>(rows, avx512);
  }
  TORCH_INTERNAL_ASSERT(false);
}

// CARTRIDGES_NO_VNNI=1 runs the AVX2 kernel on a CPU with AVX-512 VNNI: to measure what CPUs
// without it get.
std::atomic<bool> vnni_allowed{std::getenv("CARTRIDGES_NO_VNNI") == nullptr};

// Off only in tests of the scalar path.
std::atomic<bool> simd_allowed{true};

// Whether the AVX-512 VNNI kernel runs: the CPU has it, and CARTRIDGES_NO_VNNI is not set.
bool use_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes && vnni_allowed.load(std::memory_order_relaxed);
}

}  // namespace

bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}

void int8_linear(const float* x, int64_t rows, const QuantizedMatrix& w, float* y) {
  TORCH_CHECK(w.int8_weights.defined() && w.int8_scales.defined(),
              "quantized_linear: the matrix has no int8 layout (build it with quantized_matrix())");
  const int64_t out = w.out_features(), groups = (out + kInt8Group - 1) / kInt8Group;
  const bool avx2 = cpu_has_avx2() && simd_allowed.load(std::memory_order_relaxed), avx512 = avx2 && use_avx512();
  // Rounded once, before the threads split the weights (a few microseconds).
  const Int8Rows xq = round_rows(x, rows, w.in_features, avx2);
  const int64_t per_pass = avx512 ? kAvx512RowsPerPass : kAvx2RowsPerPass;
  // Groups are independent: threads split them in chunks that keep each streaming through
  // whole groups. Within a chunk, a tile of groups of up to 256 KiB of weights (in L2) serves
  // every pass of rows before the next tile is read; many rows (a prompt) go 64 at a time, so
  // that their activations stay in cache while every tile passes them. Tiles of 4 groups (a few
  // KiB, in L1) measured 1.15-1.25x slower at 16 and 64 rows: each tile began a new stream
  // from memory (docs/experiments.md, "Does the int8 kernel's tile size matter?").
  constexpr int64_t kTileBytes = 256 << 10, kRowChunk = 64;
  const int64_t group_bytes = (w.int8_weights.nbytes() + w.int8_scales.nbytes()) / groups;
  const int64_t tile_groups = std::max<int64_t>(1, kTileBytes / std::max<int64_t>(1, group_bytes));
  auto multiply = [&](int64_t first_row, int64_t last_row, int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += tile_groups) {
      const int64_t tile_end = std::min(tile + tile_groups, end);
      for (int64_t r0 = first_row; r0 < last_row; r0 += per_pass) {
        const int64_t pass = std::min(per_pass, last_row - r0);
        if (avx2) {
          simd_kernel(w.format, pass, avx512)(w, xq, r0, y, out, tile, tile_end);
        } else {
          scalar_rows(w, xq, r0, pass, y, out, tile, tile_end);
        }
      }
    }
  };
  for (int64_t first = 0; first < rows; first += kRowChunk) {
    const int64_t last = std::min(first + kRowChunk, rows);
    parallel_for(0, groups, /*grain_size=*/4, [&](int64_t begin, int64_t end) { multiply(first, last, begin, end); });
  }
}

bool allow_vnni_for_testing(bool allowed) { return vnni_allowed.exchange(allowed); }

bool allow_simd_for_testing(bool allowed) { return simd_allowed.exchange(allowed); }

at::Tensor round_activations_int8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.size(-1) % kBlock == 0,
              "round_activations_int8: x must be float32 on CPU with a multiple of 32 features");
  auto flat = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t rows = flat.size(0), in = flat.size(1);
  const auto rounded = round_rows(flat.data_ptr<float>(), rows, in, cpu_has_avx2());
  auto result = at::empty_like(flat);
  float* rp = result.data_ptr<float>();
  for (int64_t i = 0; i < rows * in; ++i) rp[i] = rounded.scale[i / kBlock] * static_cast<float>(rounded.q[i]);
  return result.view(x.sizes());
}

}  // namespace cartridges
