#include <algorithm>

#include "cartridges/engine.h"

namespace cartridges {

namespace {

bool is_stop(const SamplingParams& params, int64_t token) {
  return std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) != params.stop_token_ids.end();
}

int64_t prefix_tokens(const PrefixList& prefixes) {
  int64_t n = 0;
  for (const auto& p : prefixes) n += p->num_tokens();
  return n;
}

}  // namespace

std::vector<GenerationResult> generate(const LlamaModel& model, const std::vector<GenerationRequest>& requests,
                                       const TokenCallback& on_token) {
  const auto n = static_cast<int64_t>(requests.size());
  std::vector<GenerationResult> results(n);
  if (n == 0) return results;

  const int64_t context = model.config().max_position_embeddings;
  int64_t longest_prompt = 0, capacity = 0;
  std::vector<Sampler> samplers;
  samplers.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const auto& r = requests[i];
    const auto len = static_cast<int64_t>(r.prompt.size());
    TORCH_CHECK(len > 0, "generate: request ", i, " has an empty prompt");
    const auto needed = prefix_tokens(r.prefixes) + len + r.params.max_new_tokens;
    TORCH_CHECK(needed <= context, "generate: request ", i, " needs ", needed, " positions (prefixes + prompt + ",
                "max_new_tokens), more than the model's context of ", context);
    longest_prompt = std::max(longest_prompt, len);
    capacity = std::max(capacity, len + r.params.max_new_tokens);
    samplers.emplace_back(r.params);
  }

  // Prefill: prompts right-padded into one [n, longest] batch.
  auto tokens = at::zeros({n, longest_prompt}, at::kLong);
  ForwardBatch batch;
  batch.num_new.resize(n);
  batch.prefixes.resize(n);
  bool any_prefix = false;
  for (int64_t i = 0; i < n; ++i) {
    const auto& prompt = requests[i].prompt;
    tokens[i].narrow(0, 0, static_cast<int64_t>(prompt.size())).copy_(at::tensor(prompt, at::kLong));
    batch.num_new[i] = static_cast<int64_t>(prompt.size());
    batch.prefixes[i] = requests[i].prefixes;
    any_prefix = any_prefix || !requests[i].prefixes.empty();
  }
  if (!any_prefix) batch.prefixes.clear();
  batch.tokens = tokens;

  KVCache cache = model.new_cache(n, capacity);
  at::Tensor logits = model.forward_last(batch, &cache);  // [rows, vocab]

  std::vector<int64_t> active(n);  // request index of each cache row
  for (int64_t i = 0; i < n; ++i) active[i] = i;
  auto next = at::empty({n, 1}, at::kLong);
  while (!active.empty()) {
    std::vector<int64_t> keep;  // cache rows that go on
    auto logits_cpu = logits.to(at::kCPU);
    for (int64_t row = 0; row < static_cast<int64_t>(active.size()); ++row) {
      const int64_t i = active[row];
      const auto& params = requests[i].params;
      const int64_t token = samplers[i].sample(logits_cpu[row]);
      results[i].tokens.push_back(token);
      const bool go_on = on_token ? on_token(i, token) : true;
      if (!go_on) {
        results[i].finish_reason = "cancelled";
      } else if (is_stop(params, token)) {
        results[i].finish_reason = "stop";
      } else if (static_cast<int64_t>(results[i].tokens.size()) >= params.max_new_tokens) {
        results[i].finish_reason = "length";
      } else {
        keep.push_back(row);
      }
    }
    if (keep.empty()) break;
    if (keep.size() != active.size()) {
      // Some finished: drop their rows so later steps only compute live sequences.
      std::vector<int64_t> still_active;
      std::vector<PrefixList> still_prefixes;
      for (auto row : keep) {
        still_active.push_back(active[row]);
        if (!batch.prefixes.empty()) still_prefixes.push_back(batch.prefixes[row]);
      }
      cache.keep_rows(keep);
      active = std::move(still_active);
      batch.prefixes = std::move(still_prefixes);
      next = at::empty({static_cast<int64_t>(active.size()), 1}, at::kLong);
    }
    auto next_data = next.data_ptr<int64_t>();
    for (size_t row = 0; row < active.size(); ++row) next_data[row] = results[active[row]].tokens.back();
    batch.tokens = next;
    batch.num_new.clear();
    logits = model.forward_last(batch, &cache);
  }
  return results;
}

}  // namespace cartridges
