#pragma once
// Sampling: what a request asks for (SamplingParams) and the per-sequence sampler.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <vector>

namespace cartridges {

struct SamplingParams {
  double temperature = 0.0;  // 0 samples greedily (argmax)
  double top_p = 1.0;        // keep the smallest set of tokens holding this much probability
  int64_t top_k = 0;         // keep only the k most likely tokens; 0 keeps all
  int64_t seed = -1;         // same seed, same output; negative draws a fresh seed
  int64_t max_new_tokens = 256;
  std::vector<int64_t> stop_token_ids;  // generation ends after producing one of these
  // Also return, for every sampled token, its log-probability and the `logprobs` most likely
  // tokens with theirs, under the model's own distribution (temperature 1, no filtering).
  int64_t logprobs = 0;
  // Added to a token's logit before sampling (greedy included): OpenAI's `logit_bias`, each in
  // [-100, 100]; -100 bans the token in effect. The reported log-probabilities stay the model's own.
  std::map<int64_t, double> logit_bias;
};

// Draws tokens for one sequence; owns that sequence's random generator.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // logits: [vocab] float32, on any device.
  int64_t sample(const at::Tensor& logits);

 private:
  SamplingParams params_;
  at::Generator generator_;
};

// The index of the first largest value of a float32 [n] row, as at::argmax gives it (a NaN
// counts as largest): a greedy step's token. AVX2 where the CPU has it; ATen's argmax reads a
// 49,152-word row at about 2 ns a word, a cost paid once per sequence per decode step.
int64_t first_argmax(const at::Tensor& row);

// Logits with `bias` added to the named tokens (ids must be inside the vocabulary).
at::Tensor apply_logit_bias(const at::Tensor& logits, const std::map<int64_t, double>& bias);
// Logits with everything outside the k most likely tokens set to -inf.
at::Tensor filter_top_k(const at::Tensor& logits, int64_t k);
// Logits with everything outside the smallest most-likely set of mass >= p set to -inf.
at::Tensor filter_top_p(const at::Tensor& logits, double p);

}  // namespace cartridges
