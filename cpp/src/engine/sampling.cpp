#include <ATen/CPUGeneratorImpl.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <random>

#include "cartridges/engine.h"
#include "model/quantized_int8.h"  // cpu_has_avx2

namespace cartridges {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t seed_for(int64_t requested) {
  if (requested >= 0) return static_cast<uint64_t>(requested);
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}
// First index of the largest of x[0, n), n >= 8; -1 when a NaN is among them (ATen's argmax
// decides then). Each lane keeps its first largest value (strictly greater replaces), and the
// lanes' ties go to the smallest index.
__attribute__((target("avx2"))) int64_t first_argmax_avx2(const float* x, int64_t n) {
  __m256 best = _mm256_loadu_ps(x);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), best_index = index;
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    index = _mm256_add_epi32(index, eight);
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    best_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), greater));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) return -1;
  alignas(32) float values[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), best_index);
  int64_t found = indices[0];
  float top = values[0];
  for (int lane = 1; lane < 8; ++lane) {
    if (values[lane] > top || (values[lane] == top && indices[lane] < found)) {
      top = values[lane];
      found = indices[lane];
    }
  }
  for (; i < n; ++i) {  // the tail: later indices, so only a strictly larger value wins
    if (std::isnan(x[i])) return -1;
    if (x[i] > top) {
      top = x[i];
      found = i;
    }
  }
  return found;
}

}  // namespace

int64_t first_argmax(const at::Tensor& row) {
  if (cpu_has_avx2() && row.device().is_cpu() && row.scalar_type() == at::kFloat && row.dim() == 1 &&
      row.is_contiguous() && row.size(0) >= 8 && row.size(0) <= std::numeric_limits<int32_t>::max()) {
    const int64_t found = first_argmax_avx2(row.data_ptr<float>(), row.size(0));
    if (found >= 0) return found;
  }
  return row.argmax().item<int64_t>();
}

at::Tensor apply_logit_bias(const at::Tensor& logits, const std::map<int64_t, double>& bias) {
  if (bias.empty()) return logits;
  std::vector<int64_t> ids;
  std::vector<float> values;
  for (const auto& [id, value] : bias) {
    TORCH_CHECK(id >= 0 && id < logits.size(-1), "logit_bias names token id ", id, ", outside the vocabulary of ",
                logits.size(-1));
    ids.push_back(id);
    values.push_back(static_cast<float>(value));
  }
  return logits.index_add(-1, at::tensor(ids, at::kLong), at::tensor(values, logits.options()));
}

at::Tensor filter_top_k(const at::Tensor& logits, int64_t k) {
  if (k <= 0 || k >= logits.size(-1)) return logits;
  auto kth = std::get<0>(logits.topk(k, -1)).narrow(-1, k - 1, 1);
  return logits.masked_fill(logits < kth, kNegInf);
}

at::Tensor filter_top_p(const at::Tensor& logits, double p) {
  if (p >= 1.0) return logits;
  auto [sorted, order] = logits.sort(-1, /*descending=*/true);
  auto probs = sorted.softmax(-1);
  // A token stays when the mass strictly before it is below p; the first always stays.
  auto mass_before = probs.cumsum(-1) - probs;
  auto drop_sorted = mass_before >= p;
  drop_sorted.select(-1, 0).fill_(false);
  auto drop = at::empty_like(drop_sorted).scatter_(-1, order, drop_sorted);
  return logits.masked_fill(drop, kNegInf);
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), generator_(at::make_generator<at::CPUGeneratorImpl>(seed_for(params.seed))) {
  TORCH_CHECK(params.temperature >= 0.0, "temperature must be >= 0");
  TORCH_CHECK(params.top_p > 0.0 && params.top_p <= 1.0, "top_p must be in (0, 1]");
  TORCH_CHECK(params.max_new_tokens >= 1, "max_new_tokens must be >= 1");
  TORCH_CHECK(params.top_k >= 0, "top_k must be >= 0");
  TORCH_CHECK(params.logprobs >= 0, "logprobs must be >= 0");
  for (const auto& [id, value] : params.logit_bias) {
    TORCH_CHECK(id >= 0, "logit_bias names token id ", id, ", outside the vocabulary");
    TORCH_CHECK(value >= -100.0 && value <= 100.0, "logit_bias values must be in [-100, 100], got ", value,
                " for token ", id);
  }
}

int64_t Sampler::sample(const at::Tensor& logits) {
  auto row = apply_logit_bias(logits.to(at::kCPU, at::kFloat), params_.logit_bias);
  if (params_.temperature == 0.0) return first_argmax(row.contiguous());
  row = row / params_.temperature;
  row = filter_top_k(row, params_.top_k);
  row = filter_top_p(row, params_.top_p);
  auto probs = row.softmax(-1);
  return at::multinomial(probs, 1, /*replacement=*/false, generator_).item<int64_t>();
}

}  // namespace cartridges
