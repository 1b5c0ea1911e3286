#pragma once
// CPU attention over a prefix that every row shares and each row's own keys, as two fused
// attentions merged by their log-sum-exps.
//
// One fused attention over [prefix, own] keys needs a mask over all of them, expands the
// shared prefix per row and per query head, and computes the own keys' masked upper
// triangle. Split in two:
//  - the prefix part folds the query heads of each KV head (and, when the threads divide the
//    KV heads, every row too) into one query sequence against the prefix's keys, unmasked (or
//    with its per-key biases), never expanded per head;
//  - the own part runs causal (skipping the upper blocks) or under the row's mask.
// The backward passes each part's fused backward its share of the output gradient and the
// merged output, which gives the gradients of the whole attention exactly (the ring-attention
// identity). On a training step's shapes (4 rows of 320 tokens, 1,024 prefix tokens, 9 query
// and 3 KV heads, bfloat16), forward and backward, with ATen's fused attention for both parts,
// it is 1.16x the single fused attention on
// one thread and 1.08x on two (each row its own sequence there, for the threads to share).

#include <ATen/ATen.h>

namespace cartridges::ops {

// q [B, H, S, D]; own keys/values k, v [B, H_kv, T, D]; prefix keys/values [H_kv, P, D] (any
// number of prefixes concatenated); `prefix_bias` undefined or float32 [H_kv, P] added to the
// scaled scores on the prefix's keys. The own keys are seen under `own_mask` [B, 1, S, T]
// (additive, q's dtype), or when `own_causal` (S == T, no cached past) by position, and the mask
// is not read. Differentiable in q, k, v and the prefix's keys and values. Returns
// [B, H, S, D] in q's dtype. Where the CPU has AVX-512 BF16 and the own keys are causal, bfloat16
// q runs both parts in prefix_attention_bf16.h's kernels; so does float32 q with
// `bfloat16_attention` and no gradient wanted (its inputs then rounded to bfloat16, its output
// back to float32). Everything else runs ATen's fused attention.
at::Tensor split_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& own_mask, bool own_causal, const at::Tensor& prefix_keys,
                               const at::Tensor& prefix_values, const at::Tensor& prefix_bias,
                               bool bfloat16_attention = false);

}  // namespace cartridges::ops
