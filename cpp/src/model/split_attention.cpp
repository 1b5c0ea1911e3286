#include "model/split_attention.h"

#include "model/fused_cpu.h"
#include "model/prefix_attention_bf16.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>

namespace cartridges::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [B, H, S, D] with H = H_kv * G  <->  [N, H_kv, (B / N) * G * S, D]: the query heads of a KV
// head (query head h reads KV head h / G) and B / N rows in one query sequence. N = 1 reads the
// prefix once for the whole batch; N = B gives B * H_kv independent sequences to share among
// threads (ATen's fused backward splits its work by sequence and head only).
at::Tensor fold(const at::Tensor& x, int64_t kv_heads, int64_t sequences) {
  const auto B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  return x.reshape({sequences, B / sequences, kv_heads, H / kv_heads, S, D})
      .transpose(1, 2)
      .reshape({sequences, kv_heads, B / sequences * (H / kv_heads) * S, D});
}

at::Tensor unfold(const at::Tensor& x, int64_t batch, int64_t steps) {
  const auto sequences = x.size(0), kv_heads = x.size(1), D = x.size(-1);
  const auto rows = batch / sequences, groups = x.size(2) / (rows * steps);
  return x.reshape({sequences, kv_heads, rows, groups, steps, D})
      .transpose(1, 2)
      .reshape({batch, kv_heads * groups, steps, D});
}

// The per-query log-sum-exp [N, H_kv, L] of the folded part, back to [B, H, S].
at::Tensor unfold_lse(const at::Tensor& lse, int64_t batch, int64_t steps) {
  return unfold(lse.unsqueeze(-1), batch, steps).squeeze(-1);
}

struct SplitAttention : public torch::autograd::Function<SplitAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& prefix_keys, const at::Tensor& prefix_values,
                            const std::optional<at::Tensor>& own_mask, bool own_causal,
                            const std::optional<at::Tensor>& prefix_mask) {
    const auto B = q.size(0), H = q.size(1), S = q.size(2);
    const auto kv_heads = k.size(1), groups = H / kv_heads;
    // One sequence per KV head when the threads divide the heads evenly, else one per row and head.
    const int64_t sequences = kv_heads % at::get_num_threads() == 0 ? 1 : B;
    auto folded_q = fold(q, kv_heads, sequences);
    auto pk = prefix_keys.unsqueeze(0).expand({sequences, -1, -1, -1});
    auto pv = prefix_values.unsqueeze(0).expand({sequences, -1, -1, -1});
    std::optional<at::Tensor> pmask;
    if (prefix_mask) pmask = prefix_mask->expand({sequences, -1, -1, -1});
    auto [prefix_out, prefix_lse] =
        at::_scaled_dot_product_flash_attention_for_cpu(folded_q, pk, pv, 0.0, false, pmask);
    auto own_k = groups == 1 ? k : k.repeat_interleave(groups, 1);
    auto own_v = groups == 1 ? v : v.repeat_interleave(groups, 1);
    auto [own_out, own_lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, own_k, own_v, 0.0, own_causal, own_mask);

    // Each part's share of the softmax mass, per query.
    auto prefix_lse_rows = unfold_lse(prefix_lse, B, S);
    auto lse = at::logaddexp(prefix_lse_rows, own_lse);
    auto prefix_share = (prefix_lse_rows - lse).exp_().unsqueeze(-1);
    auto own_share = (own_lse - lse).exp_().unsqueeze(-1);
    auto out = (unfold(prefix_out, B, S).to(at::kFloat).mul_(prefix_share) + own_out.to(at::kFloat).mul_(own_share))
                   .to(q.scalar_type());

    // The masks are constants (no gradient), kept beside the saved variables.
    ctx->save_for_backward({folded_q, q, own_k, own_v, pk, pv, out, prefix_lse, own_lse, prefix_share, own_share});
    ctx->saved_data["own_mask"] = own_mask;
    ctx->saved_data["prefix_mask"] = pmask;
    ctx->saved_data["own_causal"] = own_causal;
    ctx->saved_data["kv_heads"] = kv_heads;
    ctx->saved_data["sequences"] = sequences;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& folded_q = saved[0];
    const auto& q = saved[1];
    const auto &own_k = saved[2], &own_v = saved[3], &pk = saved[4], &pv = saved[5], &out = saved[6];
    const auto &prefix_lse = saved[7], &own_lse = saved[8], &prefix_share = saved[9], &own_share = saved[10];
    const auto mask = ctx->saved_data["own_mask"].toOptional<at::Tensor>();
    const auto prefix_mask = ctx->saved_data["prefix_mask"].toOptional<at::Tensor>();
    const bool own_causal = ctx->saved_data["own_causal"].toBool();
    const int64_t kv_heads = ctx->saved_data["kv_heads"].toInt();
    const int64_t sequences = ctx->saved_data["sequences"].toInt();
    const auto B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), T = own_k.size(2);
    const auto groups = H / kv_heads;

    // Each part's fused backward, given its share of the output gradient and the merged output
    // (from which it takes rowsum(dO * O)), yields the whole attention's gradients for its keys.
    auto grad = grads[0].to(at::kFloat);
    auto prefix_grad = (grad * prefix_share).to(q.scalar_type());
    auto own_grad = (grad * own_share).to(q.scalar_type());
    auto [dq_prefix, dpk, dpv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        fold(prefix_grad, kv_heads, sequences), folded_q, pk, pv, fold(out, kv_heads, sequences), prefix_lse, 0.0,
        false, prefix_mask);
    auto [dq_own, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        own_grad, q, own_k, own_v, out, own_lse, 0.0, own_causal, mask);
    if (groups > 1) {
      dk = dk.reshape({B, kv_heads, groups, T, D}).sum(2);
      dv = dv.reshape({B, kv_heads, groups, T, D}).sum(2);
    }
    return {unfold(dq_prefix, B, S) + dq_own, dk, dv, dpk.sum(0), dpv.sum(0),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Both parts in the bfloat16 kernels (prefix_attention_bf16.h), for bfloat16 q with causal own
// keys: every tensor stays in the folded layout [B, H_kv, G * S, D] from q's fold to the merged
// output's unfold, which saves the layout copies SplitAttention makes for ATen.
struct KernelSplitAttention : public torch::autograd::Function<KernelSplitAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& prefix_keys, const at::Tensor& prefix_values,
                            const std::optional<at::Tensor>& prefix_bias) {
    const auto B = q.size(0), S = q.size(2), kv_heads = k.size(1);
    const auto bias = prefix_bias.value_or(at::Tensor());
    auto folded_q = fold(q, kv_heads, B);
    auto own_k = k.contiguous(), own_v = v.contiguous();
    auto [prefix_out, prefix_lse] = prefix_attention_bf16(folded_q, prefix_keys, prefix_values, bias);
    auto [own_out, own_lse] = causal_attention_bf16(folded_q, own_k, own_v);
    auto lse = at::logaddexp(prefix_lse, own_lse);
    auto prefix_share = (prefix_lse - lse).exp_();  // [N, H_kv, L]: each part's share of a query's whole
    auto own_share = (own_lse - lse).exp_();
    auto out = weighted_row_sum_cpu(prefix_out, prefix_share, own_out, own_share);
    ctx->save_for_backward(
        {folded_q, own_k, own_v, prefix_keys, prefix_values, out, prefix_lse, own_lse, prefix_share, own_share});
    ctx->saved_data["bias"] = prefix_bias;
    return unfold(out, B, S);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &folded_q = saved[0], &own_k = saved[1], &own_v = saved[2], &pk = saved[3], &pv = saved[4];
    const auto &out = saved[5], &prefix_lse = saved[6], &own_lse = saved[7];
    const auto &prefix_share = saved[8], &own_share = saved[9];
    const auto bias = ctx->saved_data["bias"].toOptional<at::Tensor>().value_or(at::Tensor());
    const auto B = own_k.size(0), kv_heads = own_k.size(1), S = own_k.size(2);
    // Each part's backward, given its share of the output gradient and the merged output.
    auto [prefix_grad, own_grad] = scaled_rows_cpu(fold(grads[0].to(folded_q.scalar_type()), kv_heads, B),
                                                   prefix_share, own_share);
    auto [dq_prefix, dpk, dpv] = prefix_attention_bf16_backward(prefix_grad, folded_q, pk, pv, bias, out, prefix_lse);
    auto [dq_own, dk, dv] = causal_attention_bf16_backward(own_grad, folded_q, own_k, own_v, out, own_lse);
    return {unfold(dq_prefix.add_(dq_own), B, S), dk, dv, dpk, dpv, at::Tensor()};
  }
};

}  // namespace

at::Tensor split_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& own_mask, bool own_causal, const at::Tensor& prefix_keys,
                               const at::Tensor& prefix_values, const at::Tensor& prefix_bias, bool bfloat16_attention) {
  TORCH_CHECK(q.device().is_cpu(), "split_attention_cpu: tensors must be on CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && prefix_keys.dim() == 3 && q.size(1) % k.size(1) == 0,
              "split_attention_cpu: q [B, H, S, D], k [B, H_kv, T, D] and prefix keys [H_kv, P, D]");
  TORCH_CHECK(!own_causal || q.size(2) == k.size(2), "split_attention_cpu: a causal own part needs S == T");
  const auto dtype = q.scalar_type();
  // A float32 q computes in bfloat16 only without gradients: the backward takes q's dtype.
  const bool wants_grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                         prefix_keys.requires_grad() || prefix_values.requires_grad());
  const bool lowered = bfloat16_attention && !wants_grad && dtype == at::kFloat;
  if (own_causal && (dtype == at::kBFloat16 || lowered) && prefix_attention_bf16_supported(q.size(3))) {
    const auto bf16 = at::kBFloat16;
    std::optional<at::Tensor> bias;
    if (prefix_bias.defined()) bias = prefix_bias.to(at::kFloat);
    return KernelSplitAttention::apply(q.to(bf16), k.to(bf16), v.to(bf16), prefix_keys.to(bf16),
                                       prefix_values.to(bf16), bias)
        .to(dtype);
  }
  std::optional<at::Tensor> prefix_mask, mask;
  if (!own_causal) mask = own_mask.to(dtype);
  if (prefix_bias.defined()) {
    prefix_mask = prefix_bias.to(dtype).view({1, prefix_bias.size(0), 1, prefix_bias.size(1)});
  }
  return SplitAttention::apply(q, k, v, prefix_keys.to(dtype), prefix_values.to(dtype), mask, own_causal,
                               prefix_mask);
}

}  // namespace cartridges::ops
