#pragma once
// Attention of bfloat16 queries over a prefix every query shares (a cartridge, a teacher's
// window), unmasked, with the prefix's optional per-key biases, and of each row's queries over
// its own keys, causal: the two parts of split_attention.h, forward and backward, on CPUs with
// AVX-512 BF16.
//
// ATen's fused CPU attention reaches about 90 GMAC/s on two cores here in float32 and in
// bfloat16 alike: its bfloat16 path does not use the CPU's bfloat16 dot products. This kernel
// does (VDPBF16PS: products of bfloat16 pairs summed in float32), for the scores and for the
// weighted values, with an online softmax in float32 between them (FlashAttention's scheme:
// blocks of 16 queries against tiles of 64 keys, the keys and values packed once per call in
// the instruction's pair layout). The probabilities are rounded to bfloat16 before they weigh
// the values, as ATen's bfloat16 path rounds them.

#include <ATen/ATen.h>

#include <tuple>

namespace cartridges::ops {

// Whether prefix_attention_bf16 runs on this CPU (AVX-512 F, BW, VL and BF16) and takes this
// head size (64 or 128), unless disabled for tests.
bool prefix_attention_bf16_supported(int64_t head_dim);

// q [N, H_kv, L, D] bfloat16 (N sequences of L queries per KV head), prefix keys and values
// [H_kv, P, D] bfloat16, `bias` undefined or float32 [H_kv, P] added to the scaled scores.
// Returns the attention's output [N, H_kv, L, D] bfloat16 and the log-sum-exp [N, H_kv, L]
// float32 of each query's scaled, biased scores (what ATen's fused backward takes).
std::tuple<at::Tensor, at::Tensor> prefix_attention_bf16(const at::Tensor& q, const at::Tensor& keys,
                                                         const at::Tensor& values, const at::Tensor& bias);

// The gradients of prefix_attention_bf16's output for the output's gradient `grad` [N, H_kv, L,
// D] bfloat16, given the forward's output and log-sum-exp (or, for a part of an attention merged
// with others by their log-sum-exps, that part's share of the gradient, the merged output and
// the part's log-sum-exp: the ring-attention identity split_attention.h relies on). Returns dq
// [N, H_kv, L, D], and dk, dv [H_kv, P, D] summed over all N sequences, all bfloat16.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prefix_attention_bf16_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse);

// Each sequence's causal attention over its own keys, in the layout split attention folds its
// queries to: q [N, H_kv, G * T, D] (the G query heads of a KV head, T positions each), keys
// and values [N, H_kv, T, D]; the query at row g * T + i sees keys 0..i. Returns the output and
// log-sum-exp as prefix_attention_bf16 does.
std::tuple<at::Tensor, at::Tensor> causal_attention_bf16(const at::Tensor& q, const at::Tensor& keys,
                                                         const at::Tensor& values);
// Its backward: dq as q, dk and dv [N, H_kv, T, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_bf16_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& out, const at::Tensor& lse);

// Whether split attention may use the kernel (the default); returns the previous setting. For
// tests comparing it with ATen's fused attention.
bool allow_prefix_attention_bf16_for_testing(bool allowed);

}  // namespace cartridges::ops
