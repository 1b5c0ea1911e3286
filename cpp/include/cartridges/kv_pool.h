#pragma once
// The serving engine's KV memory and the packed steps that read and fill it.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "cartridges/config.h"
#include "cartridges/prefix.h"

namespace cartridges {

// KV memory of the serving engine: one slab of `capacity` token slots per layer, allocated
// once. Each sequence owns a contiguous range of slots (handed out by the engine's allocator);
// its own token j lives at slot offset + j. Prefixes (cartridges) are not in the pool.
struct KVPool {
  KVPool(const LlamaConfig& config, int64_t capacity, at::TensorOptions options);
  int64_t capacity() const { return keys.empty() ? 0 : keys[0].size(0); }
  int64_t nbytes() const;

  std::vector<at::Tensor> keys;    // per layer: [capacity, H_kv, D]
  std::vector<at::Tensor> values;  // per layer: [capacity, H_kv, D]
};

// The prefixes (cartridges) of a fixed-shape decode step, copied end to end into slabs that
// stay at one address while CUDA graphs replay reads of them: per layer keys and values
// [capacity, H_kv, D] in the model's dtype, biases [capacity, H_kv] float32 (zeros where a
// prefix has none).
struct DecodeSlab {
  std::vector<at::Tensor> keys, values, biases;
  int64_t capacity() const { return keys.empty() ? 0 : keys[0].size(0); }
};

// The inputs of a fixed-shape decode step: one int64 tensor [kDecodeInputs, R], a column per
// row. The row's new token is written at pool slot own_offset + own_length - 1 and attends to
// own_length own slots from own_offset, after prefix_length slab rows from prefix_start.
enum DecodeInput : int64_t { kToken, kPosition, kOwnOffset, kOwnLength, kPrefixStart, kPrefixLength, kDecodeInputs };

// One sequence's part of a packed step: its `num_new` tokens follow the previous sequence's
// in PackedBatch::tokens.
struct PackedSequence {
  int64_t kv_offset = 0;  // first pool slot of this sequence's own tokens
  int64_t past = 0;       // own tokens already in the pool
  int64_t num_new = 1;    // tokens of this step, written at slots kv_offset + past + j
  PrefixList prefixes;    // cartridges in front, in order (read in place, never copied)
  bool logits = true;     // whether the step returns logits at its last new token
  // Logits at every new token from `logits_from` on instead (num_new - logits_from rows):
  // scoring the prompt tokens of a sequence whose weight depends on them (composition by
  // mixture); the tokens before logits_from are read without a row (a mixture does not weigh
  // its cartridges by the chat template's opening and the system prompt).
  bool all_logits = false;
  int64_t logits_from = 0;
};

// A serving step: decode tokens and prefill chunks of many sequences, packed without padding.
struct PackedBatch {
  at::Tensor tokens;  // [N] int64, N = sum of num_new
  std::vector<PackedSequence> sequences;
};

}  // namespace cartridges
