#include "model/packed_attention.h"
#include "model/avx2.h"
#include "model/spin_pool.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

namespace cartridges::ops {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Merges partial result `b` (for rows `rows` of `into`) into `into`.
void merge_rows(PartialAttention& into, const at::Tensor& rows, const PartialAttention& b) {
  auto m_a = into.m.index_select(0, rows), l_a = into.l.index_select(0, rows), o_a = into.o.index_select(0, rows);
  auto m = at::maximum(m_a, b.m);
  auto scale_a = at::exp(m_a - m), scale_b = at::exp(b.m - m);
  into.m.index_copy_(0, rows, m);
  into.l.index_copy_(0, rows, l_a * scale_a + b.l * scale_b);
  into.o.index_copy_(0, rows, o_a * scale_a.unsqueeze(-1) + b.o * scale_b.unsqueeze(-1));
}

// Partial attention of q [Hkv, R, D] (float, scaled) over scores-producing segments; the
// caller reshapes. scores: [Hkv, R, T] with -inf where masked.
PartialAttention softmax_parts(const at::Tensor& scores, const std::vector<at::Tensor>& value_parts,
                               const std::vector<int64_t>& lengths) {
  // Every row sees at least one key (cartridges are never empty; a token sees itself), so the
  // max is finite.
  auto m = std::get<0>(scores.max(-1));  // [Hkv, R]
  auto e = at::exp(scores - m.unsqueeze(-1));
  auto l = e.sum(-1);
  at::Tensor o;
  int64_t offset = 0;
  for (size_t i = 0; i < value_parts.size(); ++i) {
    const auto& v = value_parts[i];  // read in its own dtype: a bfloat16 cartridge is never converted
    auto part = at::matmul(e.narrow(-1, offset, lengths[i]).to(v.scalar_type()), v).to(at::kFloat);  // [Hkv, R, D]
    o = o.defined() ? o + part : part;
    offset += lengths[i];
  }
  return {o, m, l};
}

// [Hkv, R*G, X] (rows ordered r-major within each kv head) -> [R, Hkv*G, X], and back.
at::Tensor heads_last(const at::Tensor& t, int64_t rows, int64_t groups) {
  const auto kv = t.size(0);
  auto shaped = t.view({kv, rows, groups, -1}).permute({1, 0, 2, 3});  // [R, Hkv, G, X]
  return shaped.reshape({rows, kv * groups, -1});
}
at::Tensor heads_first(const at::Tensor& t, int64_t kv_heads) {
  const auto rows = t.size(0), groups = t.size(1) / kv_heads;
  return t.view({rows, kv_heads, groups, -1}).permute({1, 0, 2, 3}).reshape({kv_heads, rows * groups, -1});
}

// A row's attention must come out the same however its prompt was cut into chunks and whatever
// else the step holds: with int8 activations, one last-bit difference in a row's attention
// flips roundings of its activations downstream and moves its log-probs by up to 0.1 nats
// (docs/design.md, "A reply does not depend on its neighbours"). Measured with this build's
// ATen and MKL (cpp/tests/packed_attention_test.cc): ATen's fused CPU attention computes a row
// the same way in any call whose keys it cuts into the same blocks (of kFusedKeyBlock keys and
// a shorter last one, whose length changes how its values are summed) and whose blocks of
// queries hold at least 4 rows (MKL multiplies fewer by another kernel). So queries are padded
// with zero rows to a multiple of kFusedQueryRows (ATen's query blocks are 32, 64 or 256 rows)
// and each row's keys are cut where its position alone says:
// - a row in the first kFusedKeyBlock positions, in a call over the keys up to the end of its
//   block of kFusedEarlyRows positions (a few short calls: a short prompt wastes few keys);
// - a later row, in one call over the keys padded with masked zeros to whole blocks.
constexpr int64_t kFusedKeyBlock = 512;
constexpr int64_t kFusedQueryRows = 32;
constexpr int64_t kFusedEarlyRows = 128;
// Fewer rows than this take another MKL kernel than more do.
constexpr int64_t kMinProductRows = 4;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// ATen's fused attention of queries q [r, H, D] at positions first, first + 1, ... over the first
// `key_count` keys of k, v [Hkv, T, D], causal; keys past the `written` ones are zeros (masked).
// Returns o [r, H, D] and the log-sum-exp [r, H].
std::tuple<at::Tensor, at::Tensor> fused_rows(const at::Tensor& q, int64_t first, const at::Tensor& k,
                                              const at::Tensor& v, int64_t written, int64_t key_count) {
  const int64_t r = q.size(0), rows_padded = round_up(r, kFusedQueryRows);
  auto keys = [&](const at::Tensor& t) {
    return key_count <= written ? t.narrow(1, 0, key_count)
                                : at::constant_pad_nd(t.narrow(1, 0, written), {0, 0, 0, key_count - written});
  };
  auto padded = rows_padded == r ? q : at::constant_pad_nd(q, {0, 0, 0, 0, 0, rows_padded - r});
  auto rows = at::arange(first, first + rows_padded, at::kLong).view({rows_padded, 1});
  auto cols = at::arange(key_count, at::kLong).view({1, key_count});
  auto mask = at::zeros({rows_padded, key_count}, at::kFloat).masked_fill_(cols > rows, kNegInf);
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      padded.transpose(0, 1).unsqueeze(0), keys(k).unsqueeze(0), keys(v).unsqueeze(0), /*dropout_p=*/0.0,
      /*is_causal=*/false, mask, /*scale=*/1.0);  // q comes scaled
  return {o.squeeze(0).transpose(0, 1).narrow(0, 0, r), lse.squeeze(0).transpose(0, 1).narrow(0, 0, r)};
}

// prefill_part on CPU float32: ATen's fused attention (blocked, online softmax, GQA heads read
// in place) instead of materialized scores, several times faster on long prompts. Its
// log-sum-exp is the partial's max with a sum of 1 (o is then already normalized).
PartialAttention prefill_part_fused_cpu(const at::Tensor& q_seq, const at::Tensor& k, const at::Tensor& v,
                                        const PackedSequence& s) {
  const int64_t n = q_seq.size(0), total = s.past + n;
  std::vector<at::Tensor> outputs, sums;
  for (int64_t begin = s.past; begin < std::min(total, kFusedKeyBlock);) {
    const int64_t block_end = round_up(begin + 1, kFusedEarlyRows), end = std::min(block_end, total);
    auto [o, lse] = fused_rows(q_seq.narrow(0, begin - s.past, end - begin), begin, k, v, total, block_end);
    outputs.push_back(o);
    sums.push_back(lse);
    begin = end;
  }
  if (total > kFusedKeyBlock) {
    const int64_t begin = std::max(s.past, kFusedKeyBlock);
    auto [o, lse] = fused_rows(q_seq.narrow(0, begin - s.past, total - begin), begin, k, v, total,
                               round_up(total, kFusedKeyBlock));
    outputs.push_back(o);
    sums.push_back(lse);
  }
  auto o = outputs.size() == 1 ? outputs[0] : at::cat(outputs);
  auto m = sums.size() == 1 ? sums[0] : at::cat(sums);
  return {o, m, at::ones_like(m)};
}

// Own-KV attention of a multi-token sequence (prefill chunk), causal within its range.
PartialAttention prefill_part(const at::Tensor& q_seq, const at::Tensor& keys, const at::Tensor& values,
                              const PackedSequence& s) {
  const int64_t n = q_seq.size(0), kv = keys.size(1), groups = q_seq.size(1) / kv, total = s.past + n;
  auto k = keys.narrow(0, s.kv_offset, total).transpose(0, 1);    // [Hkv, T, D]
  auto v = values.narrow(0, s.kv_offset, total).transpose(0, 1);  // [Hkv, T, D]
  if (q_seq.device().is_cpu() && k.scalar_type() == at::kFloat) return prefill_part_fused_cpu(q_seq, k, v, s);
  auto qg = heads_first(q_seq, kv).to(k.scalar_type());            // [Hkv, n*G, D]
  auto scores = at::matmul(qg, k.transpose(-1, -2)).to(at::kFloat).view({kv, n, groups, total});
  auto rows = at::arange(n, at::TensorOptions().dtype(at::kLong).device(q_seq.device())).view({n, 1});
  auto cols = at::arange(total, at::TensorOptions().dtype(at::kLong).device(q_seq.device())).view({1, total});
  auto hidden = (cols > rows + s.past).view({1, n, 1, total});
  scores = scores.masked_fill(hidden, kNegInf).view({kv, n * groups, total});
  auto part = softmax_parts(scores, {v}, {total});
  return {heads_last(part.o, n, groups), heads_last(part.m.unsqueeze(-1), n, groups).squeeze(-1),
          heads_last(part.l.unsqueeze(-1), n, groups).squeeze(-1)};
}

// Partial attention of gathered rows: q [R, Hkv, G, D] (scaled, in the keys' dtype) over
// k, v [R, L, Hkv, D] with an additive float32 mask [R, 1, 1, L] and, when defined, biases
// [R, Hkv, 1, P] on the first P keys. Returns o [R, H, D], m and l [R, H] in float32.
PartialAttention gathered_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& mask, const at::Tensor& bias) {
  const int64_t rows = q.size(0), heads = q.size(1) * q.size(2), dim = q.size(3);
  auto scores = at::matmul(q, k.permute({0, 2, 3, 1})).to(at::kFloat) + mask;  // [R, Hkv, G, L]
  if (bias.defined()) scores.narrow(-1, 0, bias.size(-1)).add_(bias);
  auto m = std::get<0>(scores.max(-1));
  auto e = at::exp(scores - m.unsqueeze(-1));
  auto o = at::matmul(e.to(v.scalar_type()), v.transpose(1, 2)).to(at::kFloat);  // [R, Hkv, G, D]
  return {o.reshape({rows, heads, dim}), m.reshape({rows, heads}), e.sum(-1).reshape({rows, heads})};
}

// Attention of the one-token rows on the gathered path (any device): each row's own range of
// pool slots and the prefixes folded into it, gathered and padded into [R, L] keys, in one
// batch of matrix products whatever the number of distinct cartridges.
PartialAttention decode_part_gathered(const at::Tensor& q_rows, const at::Tensor& keys, const at::Tensor& values,
                                      const PackedLayout& layout, int64_t layer) {
  const int64_t rows = q_rows.size(0), kv = keys.size(1), dim = keys.size(2), groups = q_rows.size(1) / kv;
  auto gather = [&](const at::Tensor& source, const at::Tensor& slots) {  // source [T, Hkv, D]
    return source.index_select(0, slots).view({rows, -1, kv, dim});     // [R, L, Hkv, D]
  };
  auto k = gather(keys, layout.decode_slots), v = gather(values, layout.decode_slots);
  at::Tensor bias;  // [R, Hkv, 1, longest_prefix]
  if (layout.decode_prefix_slots.defined()) {
    std::vector<at::Tensor> pk, pv, pb;
    for (const auto* p : layout.decode_folded) {
      pk.push_back(p->keys[layer].transpose(0, 1));  // [P, Hkv, D]
      pv.push_back(p->values[layer].transpose(0, 1));
      if (layout.decode_folded_biases) {
        pb.push_back(p->biases.empty() ? at::zeros({p->num_tokens(), kv}, q_rows.options().dtype(at::kFloat))
                                       : p->biases[layer].transpose(0, 1));  // [P, Hkv]
      }
    }
    const auto& slots = layout.decode_prefix_slots;
    k = at::cat({gather(at::cat(pk).to(keys.scalar_type()), slots), k}, 1);
    v = at::cat({gather(at::cat(pv).to(values.scalar_type()), slots), v}, 1);
    if (!pb.empty()) bias = at::cat(pb).index_select(0, slots).view({rows, -1, kv}).permute({0, 2, 1}).unsqueeze(2);
  }
  return gathered_attention(q_rows.view({rows, kv, groups, dim}).to(keys.scalar_type()), k, v, layout.decode_mask, bias);
}

// ---- CPU float32 kernel for one-token sequences -------------------------------------------

#define CARTRIDGES_AVX2 __attribute__((target("avx2,fma")))

CARTRIDGES_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = horizontal_sum(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

CARTRIDGES_AVX2 void axpy_avx2(float alpha, const float* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

float dot_scalar(const float* a, const float* b, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
}

void axpy_scalar(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// A run of keys (and values) of one KV head: `length` vectors of `dim` floats, `stride` apart,
// and the keys' attention biases (none for a sequence's own keys).
struct KeySegment {
  const float *k, *v;
  int64_t stride, length;
  const float* bias;
};

// exp(x) of 8 floats x <= 0 (scores less their maximum): Cephes' expf (a degree-5 polynomial
// after taking out the power of two; relative error about 1e-7), 0 below -87.3.
CARTRIDGES_AVX2 __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(two_to_n)));
}

// The horizontal sums of eight vectors a[0..7], in that order, each added as horizontal_sum
// adds a vector's lanes, ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), so that every sum
// is the same float: halves added per pair of vectors, then two rounds of hadd, whose adjacent
// pairs the lanes are first put in order for, then the sums put back in the vectors' order.
CARTRIDGES_AVX2 __m256 sums_of_eight(const __m256* a) {
  __m256 halves[4];
  for (int p = 0; p < 4; ++p) {
    const __m256 lo = _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20);  // the low halves of both
    const __m256 hi = _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31);  // the high halves
    // Per vector [v0 + v4, v1 + v5, v2 + v6, v3 + v7], reordered [s0, s2, s1, s3] for hadd.
    halves[p] = _mm256_permute_ps(_mm256_add_ps(lo, hi), _MM_SHUFFLE(3, 1, 2, 0));
  }
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(halves[0], halves[1]), _mm256_hadd_ps(halves[2], halves[3]));
  // pairs: [a0, a2, a4, a6 | a1, a3, a5, a7]
  return _mm256_permutevar8x32_ps(pairs, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The `groups` query heads of one KV head (q [groups, dim], scaled; dim a multiple of 8) over
// its key segments, each key and value read once for all the heads: fills o [groups, dim]
// (unnormalized), m and l [groups]. `scores` has room for groups * total floats.
CARTRIDGES_AVX2 void attend_kv_head_avx2(const float* q, int64_t groups, int64_t dim,
                                         const std::vector<KeySegment>& segments, int64_t total, float* scores,
                                         float* o, float* m, float* l) {
  constexpr int64_t kHeadsAtOnce = 4, kChunks = 8;  // accumulators: 4 heads, or 8 vectors of one head's output
  int64_t t = 0;
  for (const auto& seg : segments) {
    int64_t j = 0;
    // Eight keys at a time: a head's products with them accumulate in eight registers, eight
    // chains where one key at a time left each multiply-add waiting on the one before, and
    // their sums come out of one reduction; every score is the float one key at a time gives.
    for (; j + 8 <= seg.length; j += 8, t += 8) {
      const float* k = seg.k + j * seg.stride;
      const __m256 bias = seg.bias != nullptr ? _mm256_loadu_ps(seg.bias + j) : _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t c = 0; c < dim; c += 8) {
          const __m256 qc = _mm256_loadu_ps(q + g * dim + c);
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + i * seg.stride + c), acc[i]);
        }
        _mm256_storeu_ps(scores + g * total + t, _mm256_add_ps(sums_of_eight(acc), bias));
      }
    }
    for (; j < seg.length; ++j, ++t) {
      const float* k = seg.k + j * seg.stride;
      const float bias = seg.bias != nullptr ? seg.bias[j] : 0.f;
      for (int64_t g0 = 0; g0 < groups; g0 += kHeadsAtOnce) {
        const int64_t heads = std::min(kHeadsAtOnce, groups - g0);
        __m256 acc[kHeadsAtOnce] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c = 0; c < dim; c += 8) {
          const __m256 kc = _mm256_loadu_ps(k + c);
          for (int64_t h = 0; h < heads; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + h) * dim + c), kc, acc[h]);
        }
        for (int64_t h = 0; h < heads; ++h) scores[(g0 + h) * total + t] = horizontal_sum(acc[h]) + bias;
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores + g * total;
    __m256 most = _mm256_set1_ps(kNegInf);  // the maximum, 8 lanes at a time (exact in any order)
    int64_t i = 0;
    for (; i + 8 <= total; i += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(s + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most);
    float best = *std::max_element(lanes, lanes + 8);
    for (; i < total; ++i) best = std::max(best, s[i]);
    const __m256 shift = _mm256_set1_ps(best);
    __m256 sum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= total; i += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
      _mm256_storeu_ps(s + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (i < total) {  // the tail through the same polynomial: a row's figures never depend on its batch
      alignas(32) float tail[8];
      std::fill(tail, tail + 8, kNegInf);
      std::copy(s + i, s + total, tail);
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), shift));
      _mm256_store_ps(tail, e);
      std::copy(tail, tail + (total - i), s + i);
      sum = _mm256_add_ps(sum, e);
    }
    m[g] = best;
    l[g] = horizontal_sum(sum);
    for (int64_t c0 = 0; c0 < dim; c0 += 8 * kChunks) {
      const int64_t chunks = std::min(kChunks, (dim - c0) / 8);
      __m256 acc[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) acc[c] = _mm256_setzero_ps();
      int64_t u = 0;
      for (const auto& seg : segments) {
        for (int64_t j = 0; j < seg.length; ++j, ++u) {
          const float* v = seg.v + j * seg.stride + c0;
          const __m256 p = _mm256_set1_ps(s[u]);
          for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
      }
      for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(o + g * dim + c0 + 8 * c, acc[c]);
    }
  }
}

}  // namespace

// Longer than 60 lines: one OpenMP-parallel kernel, its split over heads and tokens and the online
// softmax over prefixes and own KV inside one parallel region.
void decode_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const std::vector<int64_t>& tokens, const std::vector<int64_t>& offsets,
                          const std::vector<int64_t>& lengths, const std::vector<const PrefixList*>& prefixes,
                          int64_t layer, PartialAttention& out) {
  RECORD_FUNCTION("cartridges::decode_attention_cpu", std::vector<c10::IValue>());
  TORCH_INTERNAL_ASSERT(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous());
  TORCH_INTERNAL_ASSERT(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat);
  const int64_t heads = q.size(1), dim = q.size(2), kv = keys.size(1), groups = heads / kv;
  const int64_t rows = static_cast<int64_t>(tokens.size());
  // Prefix tensors [H_kv, P, D] as float32 with contiguous rows (a slice of a prefix is fine),
  // and their biases [H_kv, P] contiguous (undefined without).
  struct PrefixTensors {
    at::Tensor k, v, bias;
  };
  std::vector<std::vector<PrefixTensors>> prefix_kv(rows);
  for (int64_t i = 0; i < rows; ++i) {
    if (prefixes[i] == nullptr) continue;
    for (const auto& p : *prefixes[i]) {
      auto k = p->keys[layer], v = p->values[layer];
      TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                  "a cartridge must be float32 for a float32 model on CPU");
      if (k.stride(2) != 1 || k.stride(1) != dim) k = k.contiguous();
      if (v.stride(2) != 1 || v.stride(1) != dim) v = v.contiguous();
      prefix_kv[i].push_back({k, v, p->biases.empty() ? at::Tensor() : p->biases[layer].contiguous()});
    }
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.o.data_ptr<float>();
  float* mp = out.m.data_ptr<float>();
  float* lp = out.l.data_ptr<float>();
  const bool avx2 = has_avx2() && dim % 8 == 0;
  const auto dot = has_avx2() ? dot_avx2 : dot_scalar;
  const auto axpy = has_avx2() ? axpy_avx2 : axpy_scalar;
  // One (row, kv head) pair per work item: its keys and values are read once for the
  // `groups` query heads that share them.
  parallel_for(0, rows * kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<KeySegment> segments;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / kv, h = w % kv, token = tokens[i];
      segments.clear();
      int64_t total = 0;
      for (const auto& [k, v, bias] : prefix_kv[i]) {
        segments.push_back({k.data_ptr<float>() + h * k.stride(0), v.data_ptr<float>() + h * v.stride(0), dim,
                            k.size(1), bias.defined() ? bias.data_ptr<float>() + h * k.size(1) : nullptr});
        total += k.size(1);
      }
      segments.push_back(
          {kp + (offsets[i] * kv + h) * dim, vp + (offsets[i] * kv + h) * dim, kv * dim, lengths[i], nullptr});
      total += lengths[i];
      if (avx2) {
        scores.resize(static_cast<size_t>(groups * total));
        const int64_t head = h * groups;
        attend_kv_head_avx2(qp + (token * heads + head) * dim, groups, dim, segments, total, scores.data(),
                            op + (token * heads + head) * dim, mp + token * heads + head, lp + token * heads + head);
        continue;
      }
      scores.resize(static_cast<size_t>(total));
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t head = h * groups + g;
        const float* qh = qp + (token * heads + head) * dim;
        float m = kNegInf;
        int64_t t = 0;
        for (const auto& seg : segments) {
          for (int64_t j = 0; j < seg.length; ++j, ++t) {
            scores[t] = dot(qh, seg.k + j * seg.stride, dim) + (seg.bias != nullptr ? seg.bias[j] : 0.f);
            m = std::max(m, scores[t]);
          }
        }
        float l = 0.f;
        for (t = 0; t < total; ++t) {
          scores[t] = std::exp(scores[t] - m);
          l += scores[t];
        }
        float* o = op + (token * heads + head) * dim;
        std::fill(o, o + dim, 0.f);
        t = 0;
        for (const auto& seg : segments) {
          for (int64_t j = 0; j < seg.length; ++j, ++t) axpy(scores[t], seg.v + j * seg.stride, o, dim);
        }
        mp[token * heads + head] = m;
        lp[token * heads + head] = l;
      }
    }
  });
}

PrefixKey prefix_key(const PrefixList& list) {
  PrefixKey key;
  for (const auto& p : list) key.push_back(p.get());
  return key;
}

namespace {

// The gathered path's indices for the one-token rows (layout.decode_* filled by the caller):
// own slots, folded prefixes' slots and the additive mask over both.
void gather_decode_rows(const PackedBatch& batch, const std::vector<bool>& folds, at::Device device,
                        PackedLayout& layout) {
  const int64_t rows = static_cast<int64_t>(layout.decode_lengths.size());
  std::vector<int64_t> prefix_start(rows, 0), prefix_len(rows, 0);
  int64_t flat = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = layout.decode_sequences[r];
    if (!folds[i]) continue;
    prefix_start[r] = flat;
    for (const auto& p : batch.sequences[i].prefixes) {
      layout.decode_folded.push_back(p.get());
      layout.decode_folded_biases = layout.decode_folded_biases || !p->biases.empty();
      prefix_len[r] += p->num_tokens();
    }
    flat += prefix_len[r];
  }
  const int64_t longest = *std::max_element(layout.decode_lengths.begin(), layout.decode_lengths.end());
  const int64_t longest_prefix = *std::max_element(prefix_len.begin(), prefix_len.end());
  auto slots = at::empty({rows, longest}, at::kLong);
  auto prefix_slots = at::zeros({rows, longest_prefix}, at::kLong);  // padding reads token 0, masked
  auto mask = at::zeros({rows, longest_prefix + longest}, at::kFloat);
  auto sp = slots.accessor<int64_t, 2>();
  auto pp = prefix_slots.accessor<int64_t, 2>();
  auto mp = mask.accessor<float, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < longest_prefix; ++t) {
      if (t < prefix_len[r]) pp[r][t] = prefix_start[r] + t;
      else mp[r][t] = kNegInf;
    }
    const int64_t len = layout.decode_lengths[r];
    for (int64_t t = 0; t < longest; ++t) {
      sp[r][t] = layout.decode_offsets[r] + std::min(t, len - 1);
      if (t >= len) mp[r][longest_prefix + t] = kNegInf;
    }
  }
  layout.decode_tokens = at::tensor(layout.decode_token_list, at::kLong).to(device);
  layout.decode_slots = slots.flatten().to(device);
  if (longest_prefix > 0) layout.decode_prefix_slots = prefix_slots.flatten().to(device);
  layout.decode_mask = mask.view({rows, 1, 1, -1}).to(device);
}

}  // namespace

PackedLayout packed_layout(const PackedBatch& batch, at::Device device, bool gathered) {
  PackedLayout layout;
  const size_t n = batch.sequences.size();
  // On the gathered path a one-token row whose prefix list no other sequence holds folds it.
  std::vector<bool> folds(n, false);
  if (gathered) {
    std::map<PrefixKey, int64_t> uses;
    for (const auto& s : batch.sequences) {
      if (!s.prefixes.empty()) ++uses[prefix_key(s.prefixes)];
    }
    for (size_t i = 0; i < n; ++i) {
      const auto& s = batch.sequences[i];
      folds[i] = s.num_new == 1 && !s.prefixes.empty() && uses[prefix_key(s.prefixes)] == 1;
    }
  }
  std::map<PrefixKey, size_t> group_of;
  std::vector<std::vector<int64_t>> group_token_lists;
  int64_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& s = batch.sequences[i];
    layout.token_start.push_back(start);
    if (s.num_new == 1) layout.decode_sequences.push_back(static_cast<int64_t>(i));
    if (!s.prefixes.empty() && !folds[i] && (gathered || s.num_new > 1)) {
      auto [it, added] = group_of.emplace(prefix_key(s.prefixes), layout.groups.size());
      if (added) {
        layout.groups.emplace_back();
        group_token_lists.emplace_back();
      }
      layout.groups[it->second].push_back(static_cast<int64_t>(i));
      for (int64_t j = 0; j < s.num_new; ++j) group_token_lists[it->second].push_back(start + j);
    }
    start += s.num_new;
  }
  if (!gathered) {  // rows of one prefix list side by side, for the kernel's cache reuse
    std::stable_sort(layout.decode_sequences.begin(), layout.decode_sequences.end(), [&](int64_t a, int64_t b) {
      const auto &pa = batch.sequences[a].prefixes, &pb = batch.sequences[b].prefixes;
      return std::lexicographical_compare(pa.begin(), pa.end(), pb.begin(), pb.end(),
                                          [](const PrefixPtr& x, const PrefixPtr& y) { return x.get() < y.get(); });
    });
  }
  for (auto i : layout.decode_sequences) {
    const auto& s = batch.sequences[i];
    layout.decode_token_list.push_back(layout.token_start[i]);
    layout.decode_offsets.push_back(s.kv_offset);
    layout.decode_lengths.push_back(s.past + 1);
    layout.decode_prefixes.push_back(s.prefixes.empty() ? nullptr : &s.prefixes);
  }
  for (const auto& list : group_token_lists) layout.group_tokens.push_back(at::tensor(list, at::kLong).to(device));
  if (gathered && !layout.decode_lengths.empty()) gather_decode_rows(batch, folds, device, layout);
  return layout;
}

at::Tensor packed_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                            const PackedBatch& batch, const PackedLayout& layout, int64_t layer) {
  RECORD_FUNCTION("cartridges::packed_attention", std::vector<c10::IValue>());
  const int64_t tokens = q_in.size(0), heads = q_in.size(1), dim = q_in.size(2), kv = keys.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  auto q = (q_in.to(at::kFloat) * scale).contiguous();  // [N, H, D]
  auto f32 = q.options();
  // Every token is a one-token sequence or part of a prompt chunk: both paths below fill
  // every row, so the accumulators need no initial values.
  PartialAttention acc{at::empty({tokens, heads, dim}, f32), at::empty({tokens, heads}, f32),
                       at::empty({tokens, heads}, f32)};

  // Own keys, one-token sequences together.
  if (!layout.decode_sequences.empty()) {
    if (!layout.decode_slots.defined()) {
      decode_attention_cpu(q, keys, values, layout.decode_token_list, layout.decode_offsets, layout.decode_lengths,
                           layout.decode_prefixes, layer, acc);
    } else {
      auto rows = layout.decode_tokens;
      auto part = decode_part_gathered(q.index_select(0, rows), keys, values, layout, layer);
      acc.o.index_copy_(0, rows, part.o);
      acc.m.index_copy_(0, rows, part.m);
      acc.l.index_copy_(0, rows, part.l);
    }
  }
  // Own keys of prefill chunks, one sequence at a time (each is a matrix product of its own).
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const auto& s = batch.sequences[i];
    if (s.num_new == 1) continue;
    const int64_t start = layout.token_start[i];
    auto part = prefill_part(q.narrow(0, start, s.num_new), keys, values, s);
    acc.o.narrow(0, start, s.num_new).copy_(part.o);
    acc.m.narrow(0, start, s.num_new).copy_(part.m);
    acc.l.narrow(0, start, s.num_new).copy_(part.l);
  }
  // Prefixes: each group's rows against each segment, merged into the own results.
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const auto& prefixes = batch.sequences[layout.groups[g][0]].prefixes;
    const auto& rows = layout.group_tokens[g];
    const int64_t n = rows.size(0), groups = heads / kv;
    auto qg = heads_first(q.index_select(0, rows), kv);  // [Hkv, n*G, D]
    // Padded with zero rows to kMinProductRows, so that a row's products do not depend on how
    // many rows share them.
    if (n * groups < kMinProductRows) qg = at::constant_pad_nd(qg, {0, 0, 0, kMinProductRows - n * groups});
    std::vector<at::Tensor> scores, vals;
    std::vector<int64_t> lens;
    for (const auto& prefix : prefixes) {
      const auto& k = prefix->keys[layer];
      auto part = at::matmul(qg.to(k.scalar_type()), k.transpose(-1, -2)).to(at::kFloat);  // [Hkv, n*G, P]
      if (!prefix->biases.empty()) part = part + prefix->biases[layer].unsqueeze(1);
      scores.push_back(part);
      vals.push_back(prefix->values[layer]);
      lens.push_back(prefix->num_tokens());
    }
    auto part = softmax_parts(scores.size() == 1 ? scores[0] : at::cat(scores, -1), vals, lens);
    part = {part.o.narrow(1, 0, n * groups), part.m.narrow(1, 0, n * groups), part.l.narrow(1, 0, n * groups)};
    merge_rows(acc, rows,
               {heads_last(part.o, n, groups), heads_last(part.m.unsqueeze(-1), n, groups).squeeze(-1),
                heads_last(part.l.unsqueeze(-1), n, groups).squeeze(-1)});
  }
  return (acc.o / acc.l.unsqueeze(-1)).to(q_in.scalar_type());
}

at::Tensor fixed_decode_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                                  const DecodeSlab& slab, int64_t layer, const FixedDecodeIndex& index) {
  RECORD_FUNCTION("cartridges::fixed_decode_attention", std::vector<c10::IValue>());
  const int64_t rows = q_in.size(0), heads = q_in.size(1), dim = q_in.size(2), kv = keys.size(1);
  auto gather = [&](const at::Tensor& source, const at::Tensor& slots) {  // source [T, Hkv, D]
    return source.index_select(0, slots).view({rows, -1, kv, dim});     // [R, L, Hkv, D]
  };
  auto k = gather(keys, index.own_slots), v = gather(values, index.own_slots);
  at::Tensor bias;  // [R, Hkv, 1, P]; zeros where a prefix has none, which adds nothing
  if (index.prefix_slots.defined()) {
    k = at::cat({gather(slab.keys[layer], index.prefix_slots), k}, 1);
    v = at::cat({gather(slab.values[layer], index.prefix_slots), v}, 1);
    bias = slab.biases[layer].index_select(0, index.prefix_slots).view({rows, -1, kv}).permute({0, 2, 1}).unsqueeze(2);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  auto q = (q_in.to(at::kFloat) * scale).view({rows, kv, heads / kv, dim}).to(keys.scalar_type());
  auto part = gathered_attention(q, k, v, index.mask, bias);
  return (part.o / part.l.unsqueeze(-1)).to(q_in.scalar_type());
}

}  // namespace cartridges::ops
