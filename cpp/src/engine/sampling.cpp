#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <random>

#include "cartridges/engine.h"

namespace cartridges {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t seed_for(int64_t requested) {
  if (requested >= 0) return static_cast<uint64_t>(requested);
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}
}  // namespace

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
  if (params_.temperature == 0.0) return row.argmax().item<int64_t>();
  row = row / params_.temperature;
  row = filter_top_k(row, params_.top_k);
  row = filter_top_p(row, params_.top_p);
  auto probs = row.softmax(-1);
  return at::multinomial(probs, 1, /*replacement=*/false, generator_).item<int64_t>();
}

}  // namespace cartridges
