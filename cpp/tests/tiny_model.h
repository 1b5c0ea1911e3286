#pragma once
// A tiny random Llama-family model for the C++ tests.

#include <ATen/ATen.h>

#include <string>
#include <unordered_map>

#include "cartridges/config.h"

namespace cartridges::test_models {

inline LlamaConfig tiny_config() {
  LlamaConfig c;
  c.vocab_size = 97;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = true;
  c.max_position_embeddings = 256;
  return c;
}

inline std::unordered_map<std::string, at::Tensor> random_weights(const LlamaConfig& c) {
  std::unordered_map<std::string, at::Tensor> w;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  w["model.embed_tokens.weight"] = at::randn({c.vocab_size, c.hidden_size}) * 0.5;
  w["model.norm.weight"] = 1 + 0.1 * at::randn({c.hidden_size});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w[p + "input_layernorm.weight"] = 1 + 0.1 * at::randn({c.hidden_size});
    w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * at::randn({c.hidden_size});
    w[p + "self_attn.q_proj.weight"] = at::randn({q, c.hidden_size}) * 0.2;
    w[p + "self_attn.k_proj.weight"] = at::randn({kv, c.hidden_size}) * 0.2;
    w[p + "self_attn.v_proj.weight"] = at::randn({kv, c.hidden_size}) * 0.2;
    w[p + "self_attn.o_proj.weight"] = at::randn({c.hidden_size, q}) * 0.2;
    w[p + "mlp.gate_proj.weight"] = at::randn({c.intermediate_size, c.hidden_size}) * 0.2;
    w[p + "mlp.up_proj.weight"] = at::randn({c.intermediate_size, c.hidden_size}) * 0.2;
    w[p + "mlp.down_proj.weight"] = at::randn({c.hidden_size, c.intermediate_size}) * 0.2;
  }
  return w;
}

}  // namespace cartridges::test_models
