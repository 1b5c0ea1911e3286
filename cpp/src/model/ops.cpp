#include "model/ops.h"
#include "model/fused_cpu.h"
#include "model/spin_pool.h"
#include "model/split_attention.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

namespace cartridges::ops {

namespace {

// Inference on CPU float32 (nothing to differentiate): small per-token ops run as one loop
// instead of five or six ATen ops, whose dispatch dominates a decode step's time.
bool plain_cpu_float(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat &&
         !(c10::GradMode::is_enabled() && t.requires_grad());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool weight_trains = at::GradMode::is_enabled() && weight.requires_grad();
  if (fused_cpu_supported(x) && weight.scalar_type() == x.scalar_type() && !weight_trains) {
    return rms_norm_fused_cpu(x, weight, eps);
  }
  const auto input_dtype = x.scalar_type();
  auto h = x.to(at::kFloat);
  auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(input_dtype);
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  if (fused_cpu_supported(gate_up)) return swiglu_fused_cpu(gate_up);
  const int64_t width = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, width)) * gate_up.narrow(-1, width, width);
}

at::Tensor rope_inv_freq(const LlamaConfig& config) {
  const int64_t dim = config.head_dim;
  // Same expression as Hugging Face so that the frequencies agree to the last bit.
  auto exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  auto inv_freq = 1.0 / at::pow(config.rope_theta, exponents);
  if (config.rope_type == "llama3") {
    const double factor = config.rope_factor;
    const double low = config.rope_low_freq_factor, high = config.rope_high_freq_factor;
    const double old_len = static_cast<double>(config.rope_original_max_position_embeddings);
    const double low_freq_wavelen = old_len / low, high_freq_wavelen = old_len / high;
    auto wavelen = 2 * M_PI / inv_freq;
    auto scaled = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
    auto smooth = (old_len / wavelen - low) / (high - low);
    auto smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    auto is_medium = at::logical_not(wavelen < high_freq_wavelen) * at::logical_not(wavelen > low_freq_wavelen);
    inv_freq = at::where(is_medium, smoothed, scaled);
  } else {
    TORCH_CHECK(config.rope_type == "default", "unsupported rope_type '", config.rope_type, "'");
  }
  return inv_freq;
}

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, const at::Tensor& positions,
                                               at::ScalarType dtype) {
  // freqs: [B, S, D/2] = positions x inv_freq, in float32 like the reference.
  auto freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq.to(positions.device());
  auto emb = at::cat({freqs, freqs}, -1).unsqueeze(1);  // [B, 1, S, D]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  auto rotated = at::cat({-x2, x1}, -1);
  return x * cos + rotated * sin;
}

at::Tensor rope_and_store_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, const std::vector<int64_t>& slots, at::Tensor& pool_keys,
                              at::Tensor& pool_values) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv = k.size(1), dim = q.size(2), half = dim / 2;
  TORCH_CHECK(plain_cpu_float(q) && plain_cpu_float(k) && plain_cpu_float(v) && pool_keys.is_contiguous() &&
                  pool_values.is_contiguous() && static_cast<int64_t>(slots.size()) == tokens,
              "rope_and_store_cpu: float32 CPU tensors and one slot per token");
  auto rotated_q = at::empty({tokens, heads, dim}, q.options());
  const auto c = cos.reshape({tokens, dim}).contiguous(), s = sin.reshape({tokens, dim}).contiguous();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): the products and the sum
  // rounded one by one, as the ATen expression does (no fused multiply-add here).
  auto rotate = [&](const float* x, int64_t x_stride, const float* ct, const float* st, float* out) {
    for (int64_t j = 0; j < half; ++j) out[j] = x[j * x_stride] * ct[j] + (-x[(j + half) * x_stride]) * st[j];
    for (int64_t j = half; j < dim; ++j) out[j] = x[j * x_stride] * ct[j] + x[(j - half) * x_stride] * st[j];
  };
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* oq = rotated_q.data_ptr<float>();
  float* pk = pool_keys.data_ptr<float>();
  float* pv = pool_values.data_ptr<float>();
  parallel_for(0, tokens, /*grain_size=*/16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + t * dim;
      const float* st = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        rotate(qp + t * q.stride(0) + h * q.stride(1), q.stride(2), ct, st, oq + (t * heads + h) * dim);
      }
      for (int64_t h = 0; h < kv; ++h) {
        const int64_t slot = (slots[t] * kv + h) * dim;
        rotate(kp + t * k.stride(0) + h * k.stride(1), k.stride(2), ct, st, pk + slot);
        const float* vh = vp + t * v.stride(0) + h * v.stride(1);
        for (int64_t j = 0; j < dim; ++j) pv[slot + j] = vh[j * v.stride(2)];
      }
    }
  });
  return rotated_q;
}

at::Tensor causal_mask(const std::vector<int64_t>& past, int64_t new_tokens, int64_t total,
                       at::TensorOptions options) {
  const auto batch = static_cast<int64_t>(past.size());
  auto past_t = at::tensor(past, at::kLong).view({batch, 1, 1, 1});
  auto rows = at::arange(new_tokens, at::kLong).view({1, 1, new_tokens, 1});
  auto cols = at::arange(total, at::kLong).view({1, 1, 1, total});
  auto visible = cols <= (past_t + rows);  // [B, 1, S, T]
  auto mask = at::zeros({batch, 1, new_tokens, total}, at::kFloat);
  mask.masked_fill_(visible.logical_not(), -std::numeric_limits<float>::infinity());
  return mask.to(options.device()).to(options.dtype().toScalarType());
}

namespace {

// q grouped by KV head: [B, H_kv, G*S, D] against a segment [H_kv, P, D] shared by all rows.
// Rows are folded into the matrix dimension so the segment is never expanded per row.
at::Tensor segment_scores(const at::Tensor& qg, const at::Tensor& seg_k) {
  const auto batch = qg.size(0), kv_heads = qg.size(1), rows = qg.size(2), dim = qg.size(3);
  auto folded = qg.transpose(0, 1).reshape({kv_heads, batch * rows, dim});
  auto scores = at::matmul(folded, seg_k.transpose(-1, -2));  // [H_kv, B*G*S, P]
  return scores.view({kv_heads, batch, rows, seg_k.size(1)}).transpose(0, 1);
}

at::Tensor segment_output(const at::Tensor& probs, const at::Tensor& seg_v) {
  const auto batch = probs.size(0), kv_heads = probs.size(1), rows = probs.size(2), len = probs.size(3);
  auto folded = probs.transpose(0, 1).reshape({kv_heads, batch * rows, len});
  auto out = at::matmul(folded, seg_v);  // [H_kv, B*G*S, D]
  return out.view({kv_heads, batch, rows, seg_v.size(2)}).transpose(0, 1);
}

// On CPU, ATen's fused attention (blocked, online softmax, GQA without expanding heads) is
// 3-7x faster than scores materialized as below, and so is its backward (training). With
// prefix segments, they and the own keys are two fused attentions merged (split_attention.h):
// the prefix is read once for every row, unmasked, and the own part runs causal when it can.
at::Tensor attention_fused_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                               const PrefixList& segments, int64_t layer, bool own_causal, bool bfloat16_attention) {
  if (segments.empty()) {
    return at::scaled_dot_product_attention(q, k, v, own_causal ? std::optional<at::Tensor>() : mask,
                                            /*dropout_p=*/0.0, /*is_causal=*/own_causal, /*scale=*/std::nullopt,
                                            /*enable_gqa=*/true);
  }
  std::vector<at::Tensor> keys, values, biases;
  bool biased = false;
  for (const auto& prefix : segments) {
    keys.push_back(prefix->keys[layer]);
    values.push_back(prefix->values[layer]);
    biased = biased || !prefix->biases.empty();
  }
  at::Tensor bias;
  if (biased) {
    for (const auto& prefix : segments) {
      biases.push_back(prefix->biases.empty() ? at::zeros({k.size(1), prefix->num_tokens()}, at::kFloat)
                                              : prefix->biases[layer]);
    }
    bias = at::cat(biases, 1);
  }
  return split_attention_cpu(q, k, v, mask, own_causal, keys.size() == 1 ? keys[0] : at::cat(keys, 1),
                             values.size() == 1 ? values[0] : at::cat(values, 1), bias, bfloat16_attention);
}

// All rows of q see the same prefix segments.
at::Tensor attention_shared(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            const PrefixList& segments, int64_t layer, bool own_causal, bool bfloat16_attention = false) {
  if (q.device().is_cpu()) return attention_fused_cpu(q, k, v, mask, segments, layer, own_causal, bfloat16_attention);
  const auto batch = q.size(0), heads = q.size(1), steps = q.size(2), dim = q.size(3);
  const auto kv_heads = k.size(1), groups = heads / kv_heads, total = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  auto qg = (q * scale).reshape({batch, kv_heads, groups * steps, dim});

  std::vector<at::Tensor> scores;
  scores.reserve(segments.size() + 1);
  for (const auto& prefix : segments) {
    auto part = segment_scores(qg, prefix->keys[layer]);  // [B, H_kv, G*S, P]
    if (!prefix->biases.empty()) part = part + prefix->biases[layer].to(part.scalar_type()).unsqueeze(1);
    scores.push_back(part);
  }
  auto own = at::matmul(qg, k.transpose(-1, -2)).view({batch, kv_heads, groups, steps, total});
  own = (own + mask.unsqueeze(1)).view({batch, kv_heads, groups * steps, total});
  scores.push_back(own);

  auto all = scores.size() == 1 ? own : at::cat(scores, -1);
  auto probs = at::softmax(all.to(at::kFloat), -1).to(q.scalar_type());

  int64_t offset = 0;
  at::Tensor out;
  for (const auto& prefix : segments) {
    const auto len = prefix->num_tokens();
    auto part = segment_output(probs.narrow(-1, offset, len), prefix->values[layer]);
    out = out.defined() ? out + part : part;
    offset += len;
  }
  auto own_out = at::matmul(probs.narrow(-1, offset, total), v);
  out = out.defined() ? out + own_out : own_out;
  return out.reshape({batch, heads, steps, dim});
}

}  // namespace

at::Tensor attention_padded_prefixes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& mask, const std::vector<PrefixList>& prefixes, int64_t layer) {
  const auto batch = q.size(0), heads = q.size(1), steps = q.size(2), dim = q.size(3);
  const auto kv_heads = k.size(1), groups = heads / kv_heads, total = k.size(2);
  TORCH_CHECK(static_cast<int64_t>(prefixes.size()) == batch, "attention: one prefix list per row");
  // The distinct lists (rows usually share a few), and which one each row reads.
  std::vector<const PrefixList*> lists;
  std::vector<int64_t> which(batch);
  for (int64_t b = 0; b < batch; ++b) {
    auto found = std::find_if(lists.begin(), lists.end(), [&](const PrefixList* l) { return *l == prefixes[b]; });
    which[b] = found - lists.begin();
    if (found == lists.end()) lists.push_back(&prefixes[b]);
  }
  std::vector<int64_t> lengths;
  bool biased = false;
  for (const auto* list : lists) {
    int64_t n = 0;
    for (const auto& prefix : *list) {
      n += prefix->num_tokens();
      biased = biased || !prefix->biases.empty();
    }
    lengths.push_back(n);
  }
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  biased = biased || *std::min_element(lengths.begin(), lengths.end()) < longest;  // padding to mask
  const auto float_options = q.options().dtype(at::kFloat);
  std::vector<at::Tensor> keys, values, biases;
  for (size_t i = 0; i < lists.size(); ++i) {
    std::vector<at::Tensor> ks{k.new_zeros({kv_heads, 0, dim})}, vs{v.new_zeros({kv_heads, 0, dim})};
    std::vector<at::Tensor> bs{at::zeros({kv_heads, 0}, float_options)};
    for (const auto& prefix : *lists[i]) {
      ks.push_back(prefix->keys[layer]);
      vs.push_back(prefix->values[layer]);
      if (biased) {
        bs.push_back(prefix->biases.empty() ? at::zeros({kv_heads, prefix->num_tokens()}, float_options)
                                            : prefix->biases[layer].to(at::kFloat));
      }
    }
    const int64_t pad = longest - lengths[i];
    keys.push_back(at::constant_pad_nd(at::cat(ks, 1), {0, 0, 0, pad}));
    values.push_back(at::constant_pad_nd(at::cat(vs, 1), {0, 0, 0, pad}));
    if (biased) biases.push_back(at::constant_pad_nd(at::cat(bs, 1), {0, pad}, -std::numeric_limits<double>::infinity()));
  }
  auto index = at::tensor(which, at::kLong).to(q.device());
  auto row_keys = at::stack(keys).index_select(0, index);      // [B, H_kv, P, D]
  auto row_values = at::stack(values).index_select(0, index);  // [B, H_kv, P, D]

  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  auto qg = (q * scale).reshape({batch, kv_heads, groups * steps, dim});
  auto prefix_scores = at::matmul(qg, row_keys.transpose(-1, -2));  // [B, H_kv, G*S, P]
  if (biased) prefix_scores = prefix_scores + at::stack(biases).index_select(0, index).unsqueeze(2).to(q.scalar_type());
  auto own = at::matmul(qg, k.transpose(-1, -2)).view({batch, kv_heads, groups, steps, total});
  own = (own + mask.unsqueeze(1)).view({batch, kv_heads, groups * steps, total});
  auto probs = at::softmax(at::cat({prefix_scores, own}, -1).to(at::kFloat), -1).to(q.scalar_type());
  auto out = at::matmul(probs.narrow(-1, 0, longest), row_values) + at::matmul(probs.narrow(-1, longest, total), v);
  return out.reshape({batch, heads, steps, dim});
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     const std::vector<PrefixList>& prefixes, int64_t layer, bool shared, bool own_causal,
                     bool bfloat16_attention) {
  TORCH_INTERNAL_ASSERT(q.size(1) % k.size(1) == 0);
  TORCH_CHECK(!own_causal || q.size(2) == k.size(2), "attention: a causal step without past needs S == T");
  if (prefixes.empty()) return attention_shared(q, k, v, mask, {}, layer, own_causal);
  if (shared) return attention_shared(q, k, v, mask, prefixes[0], layer, own_causal, bfloat16_attention);
  // Rows with different prefixes. On a GPU, one batched attention over the lists padded to the
  // longest: a row at a time would cost more in kernel launches than the padding costs (the
  // training step's rows behind a companion or not). On the CPU, one row at a time, the same
  // computation on a batch of one, without the padding's arithmetic.
  if (!q.device().is_cpu()) return attention_padded_prefixes(q, k, v, mask, prefixes, layer);
  std::vector<at::Tensor> rows;
  rows.reserve(q.size(0));
  for (int64_t b = 0; b < q.size(0); ++b) {
    rows.push_back(attention_shared(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1),
                                    mask.narrow(0, b, 1), prefixes[b], layer, own_causal, bfloat16_attention));
  }
  return at::cat(rows, 0);
}

}  // namespace cartridges::ops
