#include "model/prefix_attention_bf16.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace cartridges::ops {

namespace {

constexpr int64_t kRows = 16;  // queries of one task: their scores and output stay in L1
constexpr int64_t kTile = 64;  // keys of one softmax step: four blocks of 16 (one vector each)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::atomic<bool> kernel_allowed{true};

bool cpu_has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return yes;
}

#define CARTRIDGES_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// exp(x) of 16 floats x <= 0 (scores less their running maximum; -inf gives 0): Cephes' expf,
// as packed_attention.cpp's 8-wide one, with the power of two applied by VSCALEFPS.
CARTRIDGES_AVX512_BF16 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.3f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(y, n));
}

CARTRIDGES_AVX512_BF16 inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // the same bits, as bfloat16 pairs
}

// The products both passes are made of. Matrices of bfloat16 are row-major uint16_t; a matrix
// "in pair layout" holds, per pair of its rows, per column, the two rows' values side by side
// (VDPBF16PS multiplies such pairs).

// out [16, 64] = a [16, D] times the transpose of one tile of 64 packed keys (pack_keys).
template <int64_t D>
CARTRIDGES_AVX512_BF16 void dot_tile(const uint16_t* a, const uint16_t* tile, float* out) {
  constexpr int64_t kPairs = D / 2;
  const auto* a32 = reinterpret_cast<const int32_t*>(a);
  for (int64_t g = 0; g < kRows; g += 4) {
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& x : row) x = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512i k[4];
      for (int b = 0; b < 4; ++b) k[b] = _mm512_load_si512(tile + (b * kPairs + p) * 32);
      for (int r = 0; r < 4; ++r) {
        const __m512i aa = _mm512_set1_epi32(a32[(g + r) * kPairs + p]);
        for (int b = 0; b < 4; ++b) acc[r][b] = dot_pairs(acc[r][b], aa, k[b]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int b = 0; b < 4; ++b) _mm512_store_ps(out + (g + r) * kTile + b * 16, acc[r][b]);
  }
}

// acc [rows, D] += w [rows, 2 * pairs] times m [2 * pairs, D] given in pair layout; rows a
// multiple of 4.
template <int64_t D>
CARTRIDGES_AVX512_BF16 void add_products(const uint16_t* w, int64_t rows, int64_t pairs, const uint16_t* m,
                                         float* acc_out) {
  constexpr int64_t kChunks = D / 16;
  constexpr int64_t kGroup = 16 / kChunks;  // accumulators: rows x chunks vectors, 16 at most
  const auto* w32 = reinterpret_cast<const int32_t*>(w);
  for (int64_t g = 0; g < rows; g += kGroup) {
    __m512 acc[kGroup][kChunks];
    for (int64_t r = 0; r < kGroup; ++r)
      for (int64_t c = 0; c < kChunks; ++c) acc[r][c] = _mm512_load_ps(acc_out + (g + r) * D + c * 16);
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i mm[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) mm[c] = _mm512_load_si512(m + (p * D + c * 16) * 2);
      for (int64_t r = 0; r < kGroup; ++r) {
        const __m512i ww = _mm512_set1_epi32(w32[(g + r) * pairs + p]);
        for (int64_t c = 0; c < kChunks; ++c) acc[r][c] = dot_pairs(acc[r][c], ww, mm[c]);
      }
    }
    for (int64_t r = 0; r < kGroup; ++r)
      for (int64_t c = 0; c < kChunks; ++c) _mm512_store_ps(acc_out + (g + r) * D + c * 16, acc[r][c]);
  }
}

// x with -inf where the key (tile_start + lane) is past `limit` (a causal row's last key).
CARTRIDGES_AVX512_BF16 inline __m512 hide_keys_past(__m512 x, int64_t tile_start, int64_t limit) {
  const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(tile_start)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 past = _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(limit)));
  return _mm512_mask_mov_ps(x, past, _mm512_set1_ps(kNegInf));
}

CARTRIDGES_AVX512_BF16 inline void store_bf16(uint16_t* dst, __m512 x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)h);
}

CARTRIDGES_AVX512_BF16 inline __m512 load_bf16(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// rows [n, D] -> zero-padded [kRows, D]
void copy_rows(const uint16_t* src, int64_t n, int64_t dim, uint16_t* dst) {
  std::memcpy(dst, src, sizeof(uint16_t) * n * dim);
  std::memset(dst + n * dim, 0, sizeof(uint16_t) * (kRows - n) * dim);
}

// [kRows, D] -> pair layout [kRows / 2, D, 2]
void to_pairs(const uint16_t* rows, int64_t dim, uint16_t* pairs) {
  for (int64_t p = 0; p < kRows / 2; ++p)
    for (int64_t d = 0; d < dim; ++d) {
      pairs[(p * dim + d) * 2] = rows[2 * p * dim + d];
      pairs[(p * dim + d) * 2 + 1] = rows[(2 * p + 1) * dim + d];
    }
}

// [kRows, kTile] -> [kTile, kRows]
void transpose_tile(const uint16_t* a, uint16_t* t) {
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kTile; ++j) t[j * kRows + r] = a[r * kTile + j];
}

// One KV head's keys (a prefix, or a row's own) in the kernel's layouts, padded to whole tiles.
struct PackedPrefix {
  const uint16_t* keys;         // pack_keys: the scores' right-hand side
  const uint16_t* values;       // pack_values: the weighted values' right-hand side
  const uint16_t* keys_paired;  // the keys in pack_values' layout (the backward's dQ)
  const uint16_t* values_tiled; // the values in pack_keys' layout (the backward's dP)
  // The scores' additive term per key: the bias, 0 without one, -inf past the prefix's end.
  const float* bias;
  int64_t tiles;
};

// Per query row, the last key it sees (causal attention), or none: every key.
struct KeyLimits {
  int64_t last[kRows];
  int64_t tiles;  // tiles holding a key any row sees
};

// The forward of one task: `rows` (<= kRows) queries q [rows, D] of one KV head against its
// keys (all, or up to `limits`). Writes out [rows, D] and lse [rows].
template <int64_t D>
CARTRIDGES_AVX512_BF16 void attend_rows(const uint16_t* q, int64_t rows, const PackedPrefix& prefix,
                                        const KeyLimits* limits, float scale, uint16_t* out, float* lse) {
  constexpr int64_t kChunks = D / 16;
  alignas(64) uint16_t qbuf[kRows * D];
  alignas(64) float scores[kRows * kTile];
  alignas(64) uint16_t probs[kRows * kTile];
  alignas(64) float acc_out[kRows * D];
  float row_max[kRows], row_sum[kRows];
  copy_rows(q, rows, D, qbuf);
  std::memset(acc_out, 0, sizeof(acc_out));
  for (int64_t r = 0; r < kRows; ++r) row_max[r] = kNegInf, row_sum[r] = 0.f;
  const __m512 vscale = _mm512_set1_ps(scale);

  const int64_t tiles = limits ? limits->tiles : prefix.tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    dot_tile<D>(qbuf, prefix.keys + t * kTile * D, scores);
    // Online softmax: each row's running maximum and sum, the tile's probabilities in bfloat16,
    // the output so far rescaled to the new maximum.
    const float* bt = prefix.bias + t * kTile;
    for (int64_t r = 0; r < kRows; ++r) {
      const float* s = scores + r * kTile;
      __m512 v[4];
      for (int b = 0; b < 4; ++b) {
        v[b] = _mm512_fmadd_ps(_mm512_load_ps(s + b * 16), vscale, _mm512_loadu_ps(bt + b * 16));
        if (limits) v[b] = hide_keys_past(v[b], t * kTile + b * 16, limits->last[r]);
      }
      const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
      const float new_max = std::max(row_max[r], tile_max);
      uint16_t* pr = probs + r * kTile;
      if (new_max == kNegInf) {  // nothing seen yet but -inf biases
        std::memset(pr, 0, sizeof(uint16_t) * kTile);
        continue;
      }
      const float rescale = std::exp(row_max[r] - new_max);
      const __m512 shift = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int b = 0; b < 4; ++b) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(v[b], shift));
        sum = _mm512_add_ps(sum, e);
        store_bf16(pr + b * 16, e);
      }
      row_sum[r] = row_sum[r] * rescale + _mm512_reduce_add_ps(sum);
      row_max[r] = new_max;
      if (rescale != 1.f) {
        const __m512 f = _mm512_set1_ps(rescale);
        for (int64_t c = 0; c < kChunks; ++c) {
          float* o = acc_out + r * D + c * 16;
          _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), f));
        }
      }
    }
    add_products<D>(probs, kRows, kTile / 2, prefix.values + t * kTile * D, acc_out);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 f = _mm512_set1_ps(row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f);
    for (int64_t c = 0; c < kChunks; ++c) store_bf16(out + r * D + c * 16, _mm512_mul_ps(_mm512_load_ps(acc_out + r * D + c * 16), f));
    lse[r] = row_sum[r] > 0.f ? row_max[r] + std::log(row_sum[r]) : kNegInf;
  }
}

// The backward of one task, FlashAttention's: with P = exp(S - lse) rebuilt per tile,
// dP = g V^T, dS = P (dP - rowsum(g * out)): dq [rows, D] (bfloat16) = scale dS K, and
// dS^T q and P^T g added to the head's dk, dv [padded, D] (float32, scale not yet applied).
template <int64_t D>
CARTRIDGES_AVX512_BF16 void attend_rows_backward(const uint16_t* q, const uint16_t* grad, const uint16_t* out,
                                                 const float* lse, int64_t rows, const PackedPrefix& prefix,
                                                 const KeyLimits* limits, float scale, uint16_t* dq, float* dk,
                                                 float* dv) {
  constexpr int64_t kChunks = D / 16;
  alignas(64) uint16_t qbuf[kRows * D], gbuf[kRows * D], q_pairs[kRows * D], g_pairs[kRows * D];
  alignas(64) float scores[kRows * kTile], dp[kRows * kTile], acc_dq[kRows * D];
  alignas(64) uint16_t probs[kRows * kTile], ds[kRows * kTile], probs_t[kRows * kTile], ds_t[kRows * kTile];
  float row_lse[kRows], row_delta[kRows];
  copy_rows(q, rows, D, qbuf);
  copy_rows(grad, rows, D, gbuf);
  to_pairs(qbuf, D, q_pairs);
  to_pairs(gbuf, D, g_pairs);
  std::memset(acc_dq, 0, sizeof(acc_dq));
  for (int64_t r = 0; r < kRows; ++r) {
    // Padding rows get lse +inf: their probabilities are 0 and they add nothing to dk, dv.
    row_lse[r] = r < rows ? lse[r] : std::numeric_limits<float>::infinity();
    __m512 sum = _mm512_setzero_ps();
    if (r < rows)
      for (int64_t c = 0; c < kChunks; ++c)
        sum = _mm512_fmadd_ps(load_bf16(gbuf + r * D + c * 16), load_bf16(out + r * D + c * 16), sum);
    row_delta[r] = _mm512_reduce_add_ps(sum);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t tiles = limits ? limits->tiles : prefix.tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    dot_tile<D>(qbuf, prefix.keys + t * kTile * D, scores);
    dot_tile<D>(gbuf, prefix.values_tiled + t * kTile * D, dp);
    const float* bt = prefix.bias + t * kTile;
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 shift = _mm512_set1_ps(row_lse[r]), delta = _mm512_set1_ps(row_delta[r]);
      for (int b = 0; b < 4; ++b) {
        const int64_t at = r * kTile + b * 16;
        __m512 s = _mm512_fmadd_ps(_mm512_load_ps(scores + at), vscale, _mm512_loadu_ps(bt + b * 16));
        if (limits) s = hide_keys_past(s, t * kTile + b * 16, limits->last[r]);
        const __m512 p = exp_nonpositive(_mm512_sub_ps(s, shift));
        store_bf16(probs + at, p);
        store_bf16(ds + at, _mm512_mul_ps(p, _mm512_sub_ps(_mm512_load_ps(dp + at), delta)));
      }
    }
    transpose_tile(probs, probs_t);
    transpose_tile(ds, ds_t);
    add_products<D>(ds, kRows, kTile / 2, prefix.keys_paired + t * kTile * D, acc_dq);
    add_products<D>(ds_t, kTile, kRows / 2, q_pairs, dk + t * kTile * D);
    add_products<D>(probs_t, kTile, kRows / 2, g_pairs, dv + t * kTile * D);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kChunks; ++c)
      store_bf16(dq + r * D + c * 16, _mm512_mul_ps(_mm512_load_ps(acc_dq + r * D + c * 16), vscale));
}

// The kernel's layouts of one call's keys, [K, P, D] (any strides) padded with zero keys to `padded`:
// per block of 16 keys, per pair of dimensions, the 16 keys' two values (one vector) ...
at::Tensor pack_keys(const at::Tensor& keys, int64_t padded) {
  const auto heads = keys.size(0), len = keys.size(1), dim = keys.size(2);
  auto k = at::constant_pad_nd(keys, {0, 0, 0, padded - len});
  return k.view({heads, padded / 16, 16, dim / 2, 2}).permute({0, 1, 3, 2, 4}).contiguous();
}

// ... and per pair of keys, per dimension, the two keys' values (a vector covers 16 dimensions).
at::Tensor pack_values(const at::Tensor& values, int64_t padded) {
  const auto heads = values.size(0), len = values.size(1), dim = values.size(2);
  auto v = at::constant_pad_nd(values, {0, 0, 0, padded - len});
  return v.view({heads, padded / 2, 2, dim}).permute({0, 1, 3, 2}).contiguous();
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* mutable_bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// A call's prefix packed for every KV head; `backward` adds the layouts the backward needs.
struct Packed {
  at::Tensor keys, values, keys_paired, values_tiled, bias;
  int64_t padded;
  Packed(const at::Tensor& k, const at::Tensor& v, const at::Tensor& b, bool backward) {
    const auto heads = k.size(0), len = k.size(1);
    padded = (len + kTile - 1) / kTile * kTile;
    keys = pack_keys(k, padded);
    values = pack_values(v, padded);
    if (backward) {
      keys_paired = pack_values(k, padded);
      values_tiled = pack_keys(v, padded);
    }
    bias = at::full({heads, padded}, kNegInf, at::kFloat);
    bias.narrow(1, 0, len).copy_(b.defined() ? b : at::zeros({heads, len}, at::kFloat));
  }
  PackedPrefix head(int64_t h, int64_t dim) const {
    const int64_t size = padded * dim;
    return {bits(keys) + h * size, bits(values) + h * size,
            keys_paired.defined() ? bits(keys_paired) + h * size : nullptr,
            values_tiled.defined() ? bits(values_tiled) + h * size : nullptr,
            bias.data_ptr<float>() + h * padded, padded / kTile};
  }
};

// Which keys a task's rows see: all (period 0), or causally, the row at position (row0 + r) mod
// period the keys up to it.
const KeyLimits* key_limits(int64_t period, int64_t row0, KeyLimits& limits) {
  if (period == 0) return nullptr;
  int64_t most = 0;
  for (int64_t r = 0; r < kRows; ++r) most = std::max(most, limits.last[r] = (row0 + r) % period);
  limits.tiles = most / kTile + 1;
  return &limits;
}

// q [N, H_kv, L, D]; `packed` holds H_kv heads of keys every sequence shares, or N * H_kv.
template <int64_t D>
void run_forward(const at::Tensor& q, const Packed& packed, bool shared, int64_t period, at::Tensor& out,
                 at::Tensor& lse) {
  const auto sequences = q.size(0), heads = q.size(1), len = q.size(2);
  const auto* qp = bits(q);
  auto* op = mutable_bits(out);
  float* lp = lse.data_ptr<float>();
  const int64_t blocks = (len + kRows - 1) / kRows;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, sequences * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    KeyLimits limits;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % blocks, sh = task / blocks, row0 = block * kRows;
      attend_rows<D>(qp + (sh * len + row0) * D, std::min(kRows, len - row0), packed.head(shared ? sh % heads : sh, D),
                     key_limits(period, row0, limits), scale, op + (sh * len + row0) * D, lp + sh * len + row0);
    }
  });
}

// dk, dv shaped as the keys given (H_kv heads shared, or N * H_kv).
template <int64_t D>
void run_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                  const Packed& packed, bool shared, int64_t period, at::Tensor& dq, at::Tensor& dk,
                  at::Tensor& dv) {
  const auto sequences = q.size(0), heads = q.size(1), len = q.size(2);
  const int64_t blocks = (len + kRows - 1) / kRows, head_size = packed.padded * D;
  const int64_t key_heads = packed.keys.size(0);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // dk and dv summed over every query: one float32 copy per thread, added up after.
  const int threads = at::get_num_threads();
  auto dk_parts = at::zeros({threads, key_heads, packed.padded, D}, at::kFloat);
  auto dv_parts = at::zeros({threads, key_heads, packed.padded, D}, at::kFloat);
  const auto *gp = bits(grad), *qp = bits(q), *op = bits(out);
  const float* lp = lse.data_ptr<float>();
  auto* dqp = mutable_bits(dq);
  float *dkp = dk_parts.data_ptr<float>(), *dvp = dv_parts.data_ptr<float>();
  at::parallel_for(0, sequences * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t part = at::get_thread_num() * key_heads * head_size;
    KeyLimits limits;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % blocks, sh = task / blocks, head = shared ? sh % heads : sh, row0 = block * kRows;
      const int64_t at_row = (sh * len + row0) * D;
      attend_rows_backward<D>(qp + at_row, gp + at_row, op + at_row, lp + sh * len + row0,
                              std::min(kRows, len - row0), packed.head(head, D), key_limits(period, row0, limits),
                              scale, dqp + at_row, dkp + part + head * head_size, dvp + part + head * head_size);
    }
  });
  const auto key_len = dk.size(-2);
  dk.copy_(dk_parts.sum(0).narrow(1, 0, key_len).mul_(scale).view(dk.sizes()));
  dv.copy_(dv_parts.sum(0).narrow(1, 0, key_len).view(dv.sizes()));
}

// The forward and backward for keys [K, T, D] (K = H_kv shared, or N * H_kv).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                           const at::Tensor& bias, bool shared, int64_t period) {
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  const Packed packed(keys, values, bias.defined() ? bias.contiguous() : bias, /*backward=*/false);
  if (q.size(3) == 64) {
    run_forward<64>(q.contiguous(), packed, shared, period, out, lse);
  } else {
    run_forward<128>(q.contiguous(), packed, shared, period, out, lse);
  }
  return {out, lse};
}

void backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
              const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse, bool shared, int64_t period,
              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  TORCH_CHECK(grad.sizes() == q.sizes() && out.sizes() == q.sizes() && grad.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16 && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.numel() == q.numel() / q.size(3),
              "bfloat16 attention backward: grad and out as q, lse float32 [N, H_kv, L]");
  if (q.numel() == 0) {
    dk.zero_(), dv.zero_();
    return;
  }
  const Packed packed(keys, values, bias.defined() ? bias.contiguous() : bias, /*backward=*/true);
  if (q.size(3) == 64) {
    run_backward<64>(grad.contiguous(), q.contiguous(), out.contiguous(), lse.contiguous(), packed, shared, period, dq,
                     dk, dv);
  } else {
    run_backward<128>(grad.contiguous(), q.contiguous(), out.contiguous(), lse.contiguous(), packed, shared, period,
                      dq, dk, dv);
  }
}

void check_inputs(const char* what, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& bias) {
  TORCH_CHECK(cpu_has_avx512_bf16(), what, ": this CPU has no AVX-512 BF16");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 3 && values.sizes() == keys.sizes() && q.size(1) == keys.size(0) &&
                  q.size(3) == keys.size(2),
              what, ": q [N, H_kv, L, D] and prefix keys and values [H_kv, P, D]");
  TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, what, ": head size 64 or 128, not ", q.size(3));
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              what, ": bfloat16 tensors");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.dim() == 2 &&
                                  bias.size(0) == keys.size(0) && bias.size(1) == keys.size(1)),
              what, ": bias float32 [H_kv, P]");
}

}  // namespace

bool prefix_attention_bf16_supported(int64_t head_dim) {
  return (head_dim == 64 || head_dim == 128) && kernel_allowed.load(std::memory_order_relaxed) &&
         cpu_has_avx512_bf16();
}

bool allow_prefix_attention_bf16_for_testing(bool allowed) { return kernel_allowed.exchange(allowed); }

std::tuple<at::Tensor, at::Tensor> prefix_attention_bf16(const at::Tensor& q, const at::Tensor& keys,
                                                         const at::Tensor& values, const at::Tensor& bias) {
  check_inputs("prefix_attention_bf16", q, keys, values, bias);
  return forward(q, keys, values, bias, /*shared=*/true, /*period=*/0);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> prefix_attention_bf16_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse) {
  check_inputs("prefix_attention_bf16_backward", q, keys, values, bias);
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(keys.sizes(), keys.options()), dv = at::empty(values.sizes(), values.options());
  backward(grad, q, keys, values, bias, out, lse, /*shared=*/true, /*period=*/0, dq, dk, dv);
  return {dq, dk, dv};
}

namespace {

void check_causal(const char* what, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == q.size(0), what, ": keys and values [N, H_kv, T, D]");
  check_inputs(what, q, keys[0], values[0], at::Tensor());
  TORCH_CHECK(keys.size(2) > 0 && q.size(2) % keys.size(2) == 0, what, ": q's rows a whole number of T");
}

at::Tensor flat_heads(const at::Tensor& t) { return t.reshape({-1, t.size(2), t.size(3)}); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_attention_bf16(const at::Tensor& q, const at::Tensor& keys,
                                                         const at::Tensor& values) {
  check_causal("causal_attention_bf16", q, keys, values);
  return forward(q, flat_heads(keys), flat_heads(values), at::Tensor(), /*shared=*/false, keys.size(2));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_bf16_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& out, const at::Tensor& lse) {
  check_causal("causal_attention_bf16_backward", q, keys, values);
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(keys.sizes(), keys.options()), dv = at::empty(values.sizes(), values.options());
  backward(grad, q, flat_heads(keys), flat_heads(values), at::Tensor(), out, lse, /*shared=*/false, keys.size(2), dq,
           dk, dv);
  return {dq, dk, dv};
}

}  // namespace cartridges::ops
