#pragma once
// Hyper-parameters of a Llama-family decoder: Llama 3.x, Qwen2/2.5, Qwen3, SmolLM2.

#include <cstdint>
#include <string>

namespace cartridges {

struct LlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // < num_heads for grouped-query attention
  int64_t head_dim = 0;      // usually hidden_size / num_heads; Qwen3 sets its own
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  // "default" or "llama3" (Llama 3.1+ frequency-dependent scaling of the RoPE frequencies).
  // The four fields below only matter for "llama3", whose checkpoints always give them; the
  // defaults are neutral. These defaults are the only ones: the Python ModelConfig reads them.
  std::string rope_type = "default";
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 1.0;
  int64_t rope_original_max_position_embeddings = 0;
  bool attention_bias = false;  // q/k/v projections carry a bias (Qwen2)
  bool qk_norm = false;         // per-head RMSNorm on q and k before RoPE (Qwen3)
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 2048;

  // Raises c10::Error naming the first inconsistent field.
  void validate() const;
};

}  // namespace cartridges
