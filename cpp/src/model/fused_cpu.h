#pragma once
// RMSNorm, RoPE, the SwiGLU product, split attention's merge and the distillation loss's
// softmax, each in one pass over memory, forward and backward, for float32 and bfloat16 tensors
// on the CPU. Through ATen each is several elementwise passes (in bfloat16, with conversions to
// float32 and back around them): about a quarter of the bfloat16 training step's CPU time.

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

namespace cartridges::ops {

// True when the fused kernels take x: on the CPU, float32 or bfloat16.
bool fused_cpu_supported(const at::Tensor& x);

// RMSNorm over the last dimension, differentiable in x (not in weight, which stays frozen):
// float32 statistics, then weight * to_dtype(x * rsqrt(mean(x^2) + eps)), rounded as the ATen
// expression in ops::rms_norm rounds them. weight has x's last size; it is not trained.
at::Tensor rms_norm_fused_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up for gate_up [..., 2I] holding gate in its first half and up in its second,
// differentiable; computed in float32 and rounded once to x's dtype.
at::Tensor swiglu_fused_cpu(const at::Tensor& gate_up);

// qkv [B, S, (heads + 2 kv_heads) D], the attention's fused projection, split into contiguous
// q [B, heads, S, D], k and v [B, kv_heads, S, D], with q and k rotated by RoPE (cos and sin
// [B or 1, 1, S, D], halves duplicated, as ops::rope_cos_sin makes them): the same values as
// ops::apply_rope on the heads' views, in one pass. Differentiable in qkv.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split_heads_cpu(const at::Tensor& qkv, const at::Tensor& cos,
                                                                     const at::Tensor& sin, int64_t heads,
                                                                     int64_t kv_heads);

// a * wa + b * wb with one float32 weight per row of a and b [..., n] (wa, wb [...]): the merge
// of two partial attentions by their shares of the whole, in a's dtype, rounded once.
at::Tensor weighted_row_sum_cpu(const at::Tensor& a, const at::Tensor& wa, const at::Tensor& b,
                                const at::Tensor& wb);
// (x * wa, x * wb) with one weight per row: that merge's backward, x's gradient split by the shares.
std::pair<at::Tensor, at::Tensor> scaled_rows_cpu(const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb);

// The log-sum-exp of each row of logits [T, V] (float32 or bfloat16), in float32 [T].
at::Tensor logsumexp_rows_cpu(const at::Tensor& logits);

// The gradient of a cross-entropy against sparse targets, in logits' dtype [T, V]:
// mass[t] * softmax(logits[t]) (softmax from the row's log-sum-exp lse [T]), less coef[t, k] at
// ids[t, k] ([T, K]; summed where an id repeats).
at::Tensor softmax_grad_cpu(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& mass,
                            const at::Tensor& ids, const at::Tensor& coef);

}  // namespace cartridges::ops
