#pragma once
// The building blocks of the forward, kept apart so that each is tested against plain PyTorch.

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "cartridges/config.h"
#include "cartridges/model.h"

namespace cartridges::ops {

// RMSNorm over the last dimension, computed in float32 (as Hugging Face does).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up for gate_up [..., 2I] holding gate then up (the MLP's fused projection).
at::Tensor swiglu(const at::Tensor& gate_up);

// RoPE inverse frequencies [D/2] in float32, with `llama3` scaling applied when configured.
at::Tensor rope_inv_freq(const LlamaConfig& config);

// cos and sin [B, 1, S, D] (halves duplicated) for integer positions [B, S].
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, const at::Tensor& positions,
                                               at::ScalarType dtype);

// Rotates x [B, H, S, D] by the rotate-half convention of Hugging Face Llama.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The packed step's RoPE and KV write in one pass, for CPU float32 inference: q [N, H, D]
// rotated into a new contiguous tensor; k [N, H_kv, D] rotated and v copied straight into
// pool slots `slots[i]` of pool_keys / pool_values [capacity, H_kv, D]. cos, sin: [.., N, D].
// Same values as apply_rope followed by index_copy_.
at::Tensor rope_and_store_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, const std::vector<int64_t>& slots, at::Tensor& pool_keys,
                              at::Tensor& pool_values);

// Additive mask [B, 1, S, T]: new token i of row b sits at own position past[b] + i and
// sees own keys t <= past[b] + i.
at::Tensor causal_mask(const std::vector<int64_t>& past, int64_t new_tokens, int64_t total,
                       at::TensorOptions options);

// Attention of q [B, H, S, D] over each row's prefix segments (all visible) followed by its
// own keys/values k, v [B, H_kv, T, D] under `mask` [B, 1, S, T]. `prefixes` is empty, or
// per row; when every row has the same segments pass `shared` and they are computed batched.
// `own_causal`: the mask is the plain causal one of a step without cached past (S == T), which
// the CPU path then applies by position without reading it. Returns [B, H, S, D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     const std::vector<PrefixList>& prefixes, int64_t layer, bool shared, bool own_causal = false,
                     bool bfloat16_attention = false);

// attention() for rows whose prefix lists differ, as a GPU computes it: each distinct list's
// keys and values joined and padded to the longest (the padding masked), then one batched
// attention over every row. Any device; attention() calls it off the CPU.
at::Tensor attention_padded_prefixes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& mask, const std::vector<PrefixList>& prefixes, int64_t layer);

}  // namespace cartridges::ops
