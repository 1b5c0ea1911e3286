#pragma once
// A KV prefix: the keys and values of virtual tokens in front of a sequence (a cartridge).

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cartridges/config.h"

namespace cartridges {

// Keys and values of `num_tokens()` virtual tokens for every layer: [H_kv, P, D] each, keys
// after RoPE at positions 0..P-1. Shared read-only by every sequence that uses it.
//
// `biases`: empty, or per layer float32 [H_kv, P] added to the attention logits (after the
// 1/sqrt(D) scale) of every query on the prefix's keys. A compacted cartridge uses it so
// that a few keys carry the attention mass of the many tokens they stand for.
struct KVPrefix {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
  std::vector<at::Tensor> biases;

  int64_t num_tokens() const { return keys.empty() ? 0 : keys[0].size(1); }
  int64_t nbytes() const;
};
using PrefixPtr = std::shared_ptr<const KVPrefix>;
// Prefixes concatenated in front of one sequence, in order.
using PrefixList = std::vector<PrefixPtr>;

// The one shape check of a prefix against a model: present, at least one token, and for each
// of the config's layers keys and values [num_kv_heads, P, head_dim]. Raises c10::Error
// naming `who` (the caller, for the message) otherwise.
void check_prefix(const PrefixPtr& prefix, const LlamaConfig& config, const char* who);

}  // namespace cartridges
