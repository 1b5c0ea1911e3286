#pragma once
// Sampling and batched generation over LlamaModel.

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "cartridges/model.h"

namespace cartridges {

struct SamplingParams {
  double temperature = 0.0;  // 0 samples greedily (argmax)
  double top_p = 1.0;        // keep the smallest set of tokens holding this much probability
  int64_t top_k = 0;         // keep only the k most likely tokens; 0 keeps all
  int64_t seed = -1;         // same seed, same output; negative draws a fresh seed
  int64_t max_new_tokens = 256;
  std::vector<int64_t> stop_token_ids;  // generation ends after producing one of these
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

// Logits with everything outside the k most likely tokens set to -inf.
at::Tensor filter_top_k(const at::Tensor& logits, int64_t k);
// Logits with everything outside the smallest most-likely set of mass >= p set to -inf.
at::Tensor filter_top_p(const at::Tensor& logits, double p);

struct GenerationRequest {
  std::vector<int64_t> prompt;
  SamplingParams params;
  PrefixList prefixes;  // cartridges in front of the prompt, in order
};

struct GenerationResult {
  std::vector<int64_t> tokens;  // generated tokens, the stop token included
  std::string finish_reason;    // "stop", "length" or "cancelled"
};

// Called for each token as it is produced with the request's index; returning false cancels
// that request. It runs on the generating thread.
using TokenCallback = std::function<bool(int64_t request, int64_t token)>;

// Generates for all requests as one batch: a ragged prefill, then one decode step per token
// for the requests still running. KV memory is sized to this batch.
std::vector<GenerationResult> generate(const LlamaModel& model, const std::vector<GenerationRequest>& requests,
                                       const TokenCallback& on_token = nullptr);

}  // namespace cartridges
