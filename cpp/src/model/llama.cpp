#include <algorithm>
#include <limits>
#include <numeric>

#include "cartridges/kv_pool.h"
#include "cartridges/model.h"
#include "model/fused_cpu.h"
#include "model/ops.h"
#include "model/packed_attention.h"
#include "model/quantized.h"

namespace cartridges {

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab_size > 0, "config: vocab_size must be positive");
  TORCH_CHECK(hidden_size > 0, "config: hidden_size must be positive");
  TORCH_CHECK(intermediate_size > 0, "config: intermediate_size must be positive");
  TORCH_CHECK(num_layers > 0, "config: num_layers must be positive");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "config: head counts must be positive");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "config: num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "config: head_dim must be positive and even");
  TORCH_CHECK(rope_type == "default" || rope_type == "llama3", "config: unsupported rope_type '", rope_type, "'");
  if (rope_type == "llama3") {
    TORCH_CHECK(rope_factor > 0 && rope_high_freq_factor > rope_low_freq_factor &&
                    rope_original_max_position_embeddings > 0,
                "config: llama3 RoPE scaling needs factor > 0, high_freq_factor > low_freq_factor and "
                "original_max_position_embeddings > 0");
  }
}

void check_prefix(const PrefixPtr& prefix, const LlamaConfig& c, const char* who) {
  TORCH_CHECK(prefix && static_cast<int64_t>(prefix->keys.size()) == c.num_layers &&
                  static_cast<int64_t>(prefix->values.size()) == c.num_layers,
              who, ": a cartridge must hold keys and values for each of the model's ", c.num_layers, " layers");
  TORCH_CHECK(prefix->num_tokens() > 0, who, ": a cartridge must hold at least one token");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto &k = prefix->keys[l], &v = prefix->values[l];
    TORCH_CHECK(k.dim() == 3 && k.size(0) == c.num_kv_heads && k.size(1) == prefix->num_tokens() &&
                    k.size(2) == c.head_dim && v.sizes() == k.sizes(),
                who, ": a cartridge's KV shape does not match the model (layer ", l, ")");
  }
  if (prefix->biases.empty()) return;
  TORCH_CHECK(static_cast<int64_t>(prefix->biases.size()) == c.num_layers, who,
              ": a cartridge's attention biases must cover each of the model's ", c.num_layers, " layers");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto& b = prefix->biases[l];
    TORCH_CHECK(b.dim() == 2 && b.size(0) == c.num_kv_heads && b.size(1) == prefix->num_tokens() &&
                    b.scalar_type() == at::kFloat && b.device() == prefix->keys[l].device(),
                who, ": a cartridge's attention bias must be float32 [kv heads, tokens] beside its keys (layer ", l,
                ")");
  }
}

int64_t KVPrefix::nbytes() const {
  int64_t total = 0;
  for (const auto& t : keys) total += t.nbytes();
  for (const auto& t : values) total += t.nbytes();
  for (const auto& t : biases) total += t.nbytes();
  return total;
}

KVCache::KVCache(const LlamaConfig& config, int64_t batch, int64_t capacity, at::TensorOptions options)
    : lengths(batch, 0), capacity_(capacity) {
  TORCH_CHECK(batch > 0 && capacity > 0, "KVCache: batch and capacity must be positive");
  keys.reserve(config.num_layers);
  values.reserve(config.num_layers);
  // Zeroed, not empty: rows of a ragged batch read (masked) slots they never wrote, and
  // uninitialized memory may hold NaN, which a zero attention weight does not cancel.
  for (int64_t l = 0; l < config.num_layers; ++l) {
    keys.push_back(at::zeros({batch, config.num_kv_heads, capacity, config.head_dim}, options));
    values.push_back(at::zeros({batch, config.num_kv_heads, capacity, config.head_dim}, options));
  }
}

at::Tensor Linear::operator()(const at::Tensor& x, bool int8_activations) const {
  const auto precision = int8_activations ? ActivationPrecision::kInt8 : ActivationPrecision::kFloat32;
  if (quantized && !x.requires_grad() && x.device().is_cpu() && x.scalar_type() == at::kFloat &&
      x.numel() / x.size(-1) <= max_quantized_rows(precision)) {
    auto y = quantized_linear(x, *quantized, precision);
    return bias.defined() ? y + bias : y;
  }
  return at::linear(x, weight, bias);
}

namespace {

class WeightTable {
 public:
  WeightTable(const std::unordered_map<std::string, at::Tensor>& weights, at::Device device, at::ScalarType dtype)
      : weights_(weights), device_(device), dtype_(dtype) {}

  at::Tensor get(const std::string& name, at::IntArrayRef shape) const {
    auto it = weights_.find(name);
    TORCH_CHECK(it != weights_.end(), "missing tensor '", name, "'");
    TORCH_CHECK(it->second.sizes() == shape, "tensor '", name, "' has shape ", it->second.sizes(), ", expected ",
                shape);
    return it->second.to(device_, dtype_).contiguous();
  }

 private:
  const std::unordered_map<std::string, at::Tensor>& weights_;
  at::Device device_;
  at::ScalarType dtype_;
};

// The block-quantized form of the given matrices stacked by rows, when every one of them has
// one (in the same format) and the model runs in float32 on CPU; else null.
std::shared_ptr<const QuantizedMatrix> stack_quantized(
    const std::unordered_map<std::string, QuantizedWeight>& quantized, const std::vector<std::string>& names,
    int64_t in_features, const at::Tensor& dense, at::Device device, at::ScalarType dtype) {
  if (quantized.empty() || !device.is_cpu() || dtype != at::kFloat || in_features % 32 != 0) return nullptr;
  std::vector<at::Tensor> parts;
  std::string format;
  for (const auto& name : names) {
    auto it = quantized.find(name);
    if (it == quantized.end() || (!format.empty() && it->second.format != format)) return nullptr;
    format = it->second.format;
    parts.push_back(it->second.data);
  }
  const auto block = parse_block_format(format);
  auto data = at::cat(parts).contiguous();
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.size(0) == dense.size(0) &&
                  data.size(1) == in_features / 32 * block_bytes(block),
              "quantized tensor '", names[0], "' does not match its shape ", dense.sizes(), " in ", format);
  return std::make_shared<const QuantizedMatrix>(quantized_matrix(block, data, in_features));
}

}  // namespace

LlamaModel::LlamaModel(LlamaConfig config, const std::unordered_map<std::string, at::Tensor>& weights,
                       at::Device device, at::ScalarType dtype,
                       const std::unordered_map<std::string, QuantizedWeight>& quantized)
    : config_(std::move(config)), device_(device), dtype_(dtype) {
  config_.validate();
  const auto& c = config_;
  const WeightTable w(weights, device, dtype);
  auto linear = [&](at::Tensor weight, const std::vector<std::string>& names, at::Tensor bias = {}) {
    auto q = stack_quantized(quantized, names, weight.size(1), weight, device, dtype);
    return Linear{std::move(weight), std::move(bias), std::move(q)};
  };
  const int64_t q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;

  embed_ = w.get("model.embed_tokens.weight", {c.vocab_size, c.hidden_size});
  final_norm_ = w.get("model.norm.weight", {c.hidden_size});
  const std::string head_name = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  lm_head_ = linear(c.tie_word_embeddings ? embed_ : w.get(head_name, {c.vocab_size, c.hidden_size}), {head_name});
  inv_freq_ = ops::rope_inv_freq(c).to(device);

  layers_.reserve(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer layer;
    layer.input_norm = w.get(p + "input_layernorm.weight", {c.hidden_size});
    layer.post_norm = w.get(p + "post_attention_layernorm.weight", {c.hidden_size});
    at::Tensor qkv_bias;
    if (c.attention_bias) {
      qkv_bias = at::cat({w.get(p + "self_attn.q_proj.bias", {q_dim}), w.get(p + "self_attn.k_proj.bias", {kv_dim}),
                          w.get(p + "self_attn.v_proj.bias", {kv_dim})});
    }
    layer.qkv = linear(at::cat({w.get(p + "self_attn.q_proj.weight", {q_dim, c.hidden_size}),
                                w.get(p + "self_attn.k_proj.weight", {kv_dim, c.hidden_size}),
                                w.get(p + "self_attn.v_proj.weight", {kv_dim, c.hidden_size})}),
                       {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"},
                       qkv_bias);
    if (c.qk_norm) {
      layer.q_norm = w.get(p + "self_attn.q_norm.weight", {c.head_dim});
      layer.k_norm = w.get(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    layer.o = linear(w.get(p + "self_attn.o_proj.weight", {c.hidden_size, q_dim}), {p + "self_attn.o_proj.weight"});
    layer.gate_up = linear(at::cat({w.get(p + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size}),
                                    w.get(p + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size})}),
                           {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"});
    layer.down = linear(w.get(p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}),
                        {p + "mlp.down_proj.weight"});
    layers_.push_back(std::move(layer));
  }
}

LlamaModel LlamaModel::with_dtype(at::ScalarType dtype) const {
  LlamaModel twin = *this;
  twin.dtype_ = dtype;
  const bool keep_blocks = device_.is_cpu() && dtype == at::kFloat;
  auto cast = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype).contiguous() : t; };
  auto cast_linear = [&](const Linear& l) {
    return Linear{cast(l.weight), cast(l.bias), keep_blocks ? l.quantized : nullptr};
  };
  twin.embed_ = cast(embed_);
  twin.final_norm_ = cast(final_norm_);
  twin.lm_head_ = cast_linear(lm_head_);
  if (lm_head_.weight.is_same(embed_)) twin.lm_head_.weight = twin.embed_;
  for (auto& layer : twin.layers_) {
    layer.input_norm = cast(layer.input_norm);
    layer.post_norm = cast(layer.post_norm);
    layer.q_norm = cast(layer.q_norm);
    layer.k_norm = cast(layer.k_norm);
    layer.qkv = cast_linear(layer.qkv);
    layer.o = cast_linear(layer.o);
    layer.gate_up = cast_linear(layer.gate_up);
    layer.down = cast_linear(layer.down);
  }
  return twin;
}

bool LlamaModel::products_on_quantized_kernels() const {
  if (!(device_.is_cpu() && dtype_ == at::kFloat && int8_activations_ && lm_head_.quantized)) return false;
  return std::all_of(layers_.begin(), layers_.end(), [](const Layer& l) {
    return l.qkv.quantized && l.o.quantized && l.gate_up.quantized && l.down.quantized;
  });
}

KVCache LlamaModel::new_cache(int64_t batch, int64_t capacity) const {
  return KVCache(config_, batch, capacity, options());
}

// Longer than 60 lines: the layer loop and the batch's bookkeeping it needs (prefix lengths,
// positions, cache writes, the mask); the arithmetic itself is in ops and attention().
at::Tensor LlamaModel::forward_hidden(const ForwardBatch& batch, KVCache* cache) const {
  const auto& c = config_;
  TORCH_CHECK(batch.tokens.dim() == 2, "forward: tokens must be [batch, steps], got ", batch.tokens.sizes());
  const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
  TORCH_CHECK(B > 0 && S > 0, "forward: empty batch");
  std::vector<int64_t> num_new = batch.num_new.empty() ? std::vector<int64_t>(B, S) : batch.num_new;
  TORCH_CHECK(static_cast<int64_t>(num_new.size()) == B, "forward: num_new has ", num_new.size(), " rows, batch has ", B);
  for (auto n : num_new) TORCH_CHECK(n >= 1 && n <= S, "forward: num_new entries must be in [1, ", S, "]");
  TORCH_CHECK(batch.prefixes.empty() || static_cast<int64_t>(batch.prefixes.size()) == B,
              "forward: prefixes must be empty or one list per row");

  std::vector<int64_t> past(B, 0), prefix_len(B, 0);
  if (cache != nullptr) {
    TORCH_CHECK(cache->batch() == B, "forward: cache has ", cache->batch(), " rows, batch has ", B);
    past = cache->lengths;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(past[b] + S <= cache->capacity(), "forward: KV cache full (", past[b], " + ", S, " > ",
                  cache->capacity(), ")");
    }
  }
  bool shared = true;
  for (int64_t b = 0; b < static_cast<int64_t>(batch.prefixes.size()); ++b) {
    for (const auto& prefix : batch.prefixes[b]) {
      check_prefix(prefix, c, "forward");
      prefix_len[b] += prefix->num_tokens();
    }
    shared = shared && batch.prefixes[b] == batch.prefixes[0];
  }

  // Positions continue after the prefixes and what the cache already holds.
  std::vector<int64_t> start(B);
  for (int64_t b = 0; b < B; ++b) start[b] = prefix_len[b] + past[b];
  auto positions = at::tensor(start, at::kLong).unsqueeze(1) + at::arange(S, at::kLong).unsqueeze(0);  // [B, S]
  auto [cos, sin] = ops::rope_cos_sin(inv_freq_, positions.to(device_), dtype_);

  const int64_t total = cache ? *std::max_element(past.begin(), past.end()) + S : S;
  auto mask = ops::causal_mask(past, S, total, options());
  const bool uniform_past = std::all_of(past.begin(), past.end(), [&](int64_t p) { return p == past[0]; });
  const bool own_causal = uniform_past && past[0] == 0;  // the mask is the plain causal one
  at::Tensor write_rows, write_cols;
  if (cache && !uniform_past) {
    write_rows = at::arange(B, at::kLong).repeat_interleave(S).to(device_);
    write_cols = (at::tensor(past, at::kLong).unsqueeze(1) + at::arange(S, at::kLong).unsqueeze(0)).flatten().to(device_);
  }

  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  auto x = at::embedding(embed_, batch.tokens.to(device_));  // [B, S, hidden]
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& layer = layers_[l];
    auto h = ops::rms_norm(x, layer.input_norm, c.rms_norm_eps);
    at::Tensor q, k, v;
    if (!c.qk_norm && ops::fused_cpu_supported(h)) {  // one pass, and contiguous heads for the attention
      std::tie(q, k, v) = ops::rope_split_heads_cpu(apply(layer.qkv, h), cos, sin, H, Hkv);
    } else {
      auto heads = project_qkv(layer, h);
      q = ops::apply_rope(heads.q.transpose(1, 2), cos, sin);  // [B, H, S, D]
      k = ops::apply_rope(heads.k.transpose(1, 2), cos, sin);  // [B, Hkv, S, D]
      v = heads.v.transpose(1, 2);
    }
    if (batch.queries != nullptr) batch.queries->push_back(q);

    at::Tensor keys = k, values = v;
    if (cache) {
      auto& ck = cache->keys[l];
      auto& cv = cache->values[l];
      if (uniform_past) {
        ck.narrow(2, past[0], S).copy_(k);
        cv.narrow(2, past[0], S).copy_(v);
      } else {
        using at::indexing::Slice;
        ck.index_put_({write_rows, Slice(), write_cols}, k.transpose(1, 2).reshape({B * S, Hkv, D}));
        cv.index_put_({write_rows, Slice(), write_cols}, v.transpose(1, 2).reshape({B * S, Hkv, D}));
      }
      keys = ck.narrow(2, 0, total);
      values = cv.narrow(2, 0, total);
    }
    auto attn = ops::attention(q, keys, values, mask, batch.prefixes, l, shared, own_causal,
                                batch.bfloat16_attention);  // [B, H, S, D]
    x = x + apply(layer.o, attn.transpose(1, 2).reshape({B, S, H * D}));

    x = x + mlp(layer, x);
  }
  if (cache) {
    for (int64_t b = 0; b < B; ++b) cache->lengths[b] += num_new[b];
  }
  return ops::rms_norm(x, final_norm_, c.rms_norm_eps);
}

LlamaModel::Projections LlamaModel::project_qkv(const Layer& layer, const at::Tensor& h) const {
  const auto& c = config_;
  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  auto qkv = apply(layer.qkv, h);  // [..., (H + 2 Hkv) D]
  auto lead = h.sizes().vec();
  lead.pop_back();
  auto shape = [&](int64_t heads) {
    auto s = lead;
    s.push_back(heads);
    s.push_back(D);
    return s;
  };
  auto q = qkv.narrow(-1, 0, H * D).view(shape(H));
  auto k = qkv.narrow(-1, H * D, Hkv * D).view(shape(Hkv));
  auto v = qkv.narrow(-1, (H + Hkv) * D, Hkv * D).view(shape(Hkv));
  if (c.qk_norm) {
    q = ops::rms_norm(q, layer.q_norm, c.rms_norm_eps);
    k = ops::rms_norm(k, layer.k_norm, c.rms_norm_eps);
  }
  return {q, k, v};
}

at::Tensor LlamaModel::mlp(const Layer& layer, const at::Tensor& x) const {
  auto gate_up = apply(layer.gate_up, ops::rms_norm(x, layer.post_norm, config_.rms_norm_eps));
  return apply(layer.down, ops::swiglu(gate_up));
}

namespace {

// Rotates q and k [N, heads, D] by RoPE (cos, sin [1, 1, N, D]) and writes k and v to a
// layer's pool slabs at `slots` ([N] on the device); returns the rotated q.
at::Tensor rope_and_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& slots, at::Tensor& keys, at::Tensor& values) {
  auto rotate = [&](const at::Tensor& x) {
    return ops::apply_rope(x.transpose(0, 1).unsqueeze(0), cos, sin).squeeze(0).transpose(0, 1);
  };
  keys.index_copy_(0, slots, rotate(k).contiguous());
  values.index_copy_(0, slots, v.contiguous());
  return rotate(q);
}

}  // namespace

at::Tensor LlamaModel::forward_packed(const PackedBatch& batch, KVPool& pool) const {
  const auto& c = config_;
  TORCH_CHECK(batch.tokens.dim() == 1, "forward_packed: tokens must be [N]");
  TORCH_CHECK(static_cast<int64_t>(pool.keys.size()) == c.num_layers, "forward_packed: pool has ",
              pool.keys.size(), " layers, the model ", c.num_layers);
  const int64_t N = batch.tokens.size(0);
  std::vector<int64_t> positions, slots, last;
  positions.reserve(N);
  slots.reserve(N);
  for (const auto& s : batch.sequences) {
    TORCH_CHECK(s.num_new >= 1 && s.past >= 0, "forward_packed: a sequence needs at least one new token");
    TORCH_CHECK(s.kv_offset >= 0 && s.kv_offset + s.past + s.num_new <= pool.capacity(),
                "forward_packed: a sequence's slots lie outside the pool");
    int64_t prefix_len = 0;
    // Each step of every running request passes here: the prefixes' shapes were checked once,
    // when the engine took the request (check_prefix in submit); only the layer count is kept.
    for (const auto& p : s.prefixes) {
      TORCH_CHECK(p && static_cast<int64_t>(p->keys.size()) == c.num_layers,
                  "forward_packed: a prefix must hold keys and values for each of the ", c.num_layers, " layers");
      prefix_len += p->num_tokens();
    }
    TORCH_CHECK(s.logits_from >= 0 && s.logits_from <= s.num_new, "forward_packed: logits_from must lie in [0, ",
                s.num_new, "], got ", s.logits_from);
    for (int64_t j = 0; j < s.num_new; ++j) {
      if (s.all_logits && j >= s.logits_from) last.push_back(static_cast<int64_t>(positions.size()));
      positions.push_back(prefix_len + s.past + j);
      slots.push_back(s.kv_offset + s.past + j);
    }
    if (s.logits && !s.all_logits) last.push_back(static_cast<int64_t>(positions.size()) - 1);
  }
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == N, "forward_packed: tokens hold ", N,
              " entries, the sequences ", positions.size());

  // CPU float32 has a kernel that reads each sequence's KV in place; elsewhere it is gathered.
  const auto layout = ops::packed_layout(batch, device_, !(device_.is_cpu() && dtype_ == at::kFloat));
  auto pos = at::tensor(positions, at::kLong).view({1, N}).to(device_);
  auto [cos, sin] = ops::rope_cos_sin(inv_freq_, pos, dtype_);  // [1, 1, N, D]
  auto slot_index = at::tensor(slots, at::kLong).to(device_);
  // CPU float32 inference rotates q, k and writes k, v to the pool in one pass per layer.
  const bool fused_cpu = device_.is_cpu() && dtype_ == at::kFloat && pool.keys[0].is_contiguous();

  auto x = at::embedding(embed_, batch.tokens.to(device_));  // [N, hidden]
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& layer = layers_[l];
    auto [q, k, v] = project_qkv(layer, ops::rms_norm(x, layer.input_norm, c.rms_norm_eps));  // [N, heads, D]
    if (fused_cpu) {
      q = ops::rope_and_store_cpu(q, k, v, cos, sin, slots, pool.keys[l], pool.values[l]);
    } else {
      q = rope_and_store(q, k, v, cos, sin, slot_index, pool.keys[l], pool.values[l]);
    }
    auto attn = ops::packed_attention(q, pool.keys[l], pool.values[l], batch, layout, l);  // [N, H, D]
    x = x + apply(layer.o, attn.reshape({N, -1}));
    x = x + mlp(layer, x);
  }
  if (last.empty()) return at::empty({0, c.vocab_size}, at::TensorOptions().dtype(at::kFloat).device(device_));
  auto rows = at::tensor(last, at::kLong).to(device_);
  return logits(ops::rms_norm(x.index_select(0, rows), final_norm_, c.rms_norm_eps));
}

at::Tensor LlamaModel::forward_fixed_decode(const at::Tensor& inputs, int64_t prefix_tokens, int64_t own_tokens,
                                            const DecodeSlab& slab, KVPool& pool) const {
  const auto& c = config_;
  const int64_t R = inputs.size(1), P = prefix_tokens, L = own_tokens;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device_);
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(device_);
  // Every index below is computed on the device from `inputs`: nothing reads the host.
  auto own_length = inputs[kOwnLength].view({R, 1});
  auto t = at::arange(L, longs).view({1, L});
  ops::FixedDecodeIndex index;
  index.own_slots = (inputs[kOwnOffset].view({R, 1}) + at::minimum(t, own_length - 1)).flatten();
  auto mask = at::zeros({R, L}, floats).masked_fill_(t >= own_length, kNegInf);
  if (P > 0) {
    auto prefix_length = inputs[kPrefixLength].view({R, 1});
    auto tp = at::arange(P, longs).view({1, P});
    index.prefix_slots =
        (inputs[kPrefixStart].view({R, 1}) + at::clamp_min(at::minimum(tp, prefix_length - 1), 0)).flatten();
    mask = at::cat({at::zeros({R, P}, floats).masked_fill_(tp >= prefix_length, kNegInf), mask}, 1);
  }
  index.mask = mask.view({R, 1, 1, P + L});
  auto write_slots = inputs[kOwnOffset] + inputs[kOwnLength] - 1;
  auto [cos, sin] = ops::rope_cos_sin(inv_freq_, inputs[kPosition].view({1, R}), dtype_);  // [1, 1, R, D]

  auto x = at::embedding(embed_, inputs[kToken]);  // [R, hidden]
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& layer = layers_[l];
    auto [q, k, v] = project_qkv(layer, ops::rms_norm(x, layer.input_norm, c.rms_norm_eps));  // [R, heads, D]
    q = rope_and_store(q, k, v, cos, sin, write_slots, pool.keys[l], pool.values[l]);
    auto attn = ops::fixed_decode_attention(q, pool.keys[l], pool.values[l], slab, l, index);  // [R, H, D]
    x = x + apply(layer.o, attn.reshape({R, -1}));
    x = x + mlp(layer, x);
  }
  return logits(ops::rms_norm(x, final_norm_, c.rms_norm_eps));
}

at::Tensor LlamaModel::logits(const at::Tensor& hidden) const {
  return logits_in_model_dtype(hidden).to(at::kFloat);
}

at::Tensor LlamaModel::logits_in_model_dtype(const at::Tensor& hidden) const { return apply(lm_head_, hidden); }

at::Tensor LlamaModel::forward(const ForwardBatch& batch, KVCache* cache) const {
  return logits(forward_hidden(batch, cache));
}

at::Tensor LlamaModel::forward_last(const ForwardBatch& batch, KVCache* cache) const {
  auto hidden = forward_hidden(batch, cache);
  const int64_t B = hidden.size(0), S = hidden.size(1);
  if (S == 1) return logits(hidden.squeeze(1));
  std::vector<int64_t> last(B, S - 1);
  if (!batch.num_new.empty()) {
    for (int64_t b = 0; b < B; ++b) last[b] = batch.num_new[b] - 1;
  }
  auto index = at::tensor(last, at::kLong).to(device_).view({B, 1, 1}).expand({B, 1, hidden.size(2)});
  return logits(hidden.gather(1, index).squeeze(1));
}

KVPrefix LlamaModel::prefix_from_tokens(const at::Tensor& tokens, std::vector<at::Tensor>* queries) const {
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) > 0, "prefix_from_tokens: tokens must be a non-empty 1-D tensor");
  const int64_t n = tokens.size(0);
  KVCache cache = new_cache(1, n);
  std::vector<at::Tensor> batch_queries;
  ForwardBatch batch{tokens.view({1, n}), {}, {}, queries ? &batch_queries : nullptr};
  forward_hidden(batch, &cache);
  KVPrefix prefix;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    prefix.keys.push_back(cache.keys[l][0].clone());
    prefix.values.push_back(cache.values[l][0].clone());
    if (queries) queries->push_back(batch_queries[l][0]);
  }
  return prefix;
}

at::Tensor LlamaModel::rotate(const at::Tensor& x, const at::Tensor& positions) const {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == config_.head_dim, "rotate: x must be [heads, S, head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(1), "rotate: one position per row of x");
  auto [cos, sin] = ops::rope_cos_sin(inv_freq_, positions.to(at::kLong).unsqueeze(0).to(device_), x.scalar_type());
  return ops::apply_rope(x.unsqueeze(0).to(device_), cos, sin).squeeze(0);
}

}  // namespace cartridges
