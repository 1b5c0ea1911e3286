#pragma once
// The Llama-family forward with a KV cache and optional KV prefixes (cartridges).

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cartridges/config.h"
#include "cartridges/prefix.h"

namespace cartridges {

// K/V of each sequence's own tokens (not its prefixes), sized to the batch it serves.
class KVCache {
 public:
  KVCache(const LlamaConfig& config, int64_t batch, int64_t capacity, at::TensorOptions options);

  int64_t batch() const { return static_cast<int64_t>(lengths.size()); }
  int64_t capacity() const { return capacity_; }

  std::vector<at::Tensor> keys;    // per layer: [B, H_kv, capacity, D]
  std::vector<at::Tensor> values;  // per layer: [B, H_kv, capacity, D]
  std::vector<int64_t> lengths;    // valid cached tokens per row

 private:
  int64_t capacity_;
};

// One forward call: new tokens of B sequences, right-padded to S.
struct ForwardBatch {
  at::Tensor tokens;                  // [B, S] int64
  std::vector<int64_t> num_new;       // valid tokens per row (1..S); empty = all S
  std::vector<PrefixList> prefixes;   // per row; empty = no prefixes
  // When set, receives each layer's queries [B, H, S, D] after RoPE (attention matching's
  // reference queries); null on every serving and training path.
  std::vector<at::Tensor>* queries = nullptr;
  // A float32 model's attention behind prefixes in bfloat16 where the CPU has AVX-512 BF16
  // (model/prefix_attention_bf16.h: 3-6x faster), without gradients. Self-study's teacher asks
  // for it when the cartridge trains in bfloat16; every other path leaves it off.
  bool bfloat16_attention = false;
};

// A weight matrix as stored in a GGUF file: `format` "Q4_0", "Q4_1" or "Q8_0", `data` uint8
// [out_features, row bytes]. Given beside the float32 weights, it serves decoding on CPU.
struct QuantizedWeight {
  std::string format;
  at::Tensor data;
};

struct QuantizedMatrix;

// The float32 matrix [out_features, in_features] a QuantizedWeight stands for, decoded on all
// threads: exactly the values the CPU kernel multiplies by with float32 activations.
at::Tensor dequantize_weight(const QuantizedWeight& weight, int64_t in_features);

// The serving engine's KV pool and packed steps (cartridges/kv_pool.h).
struct KVPool;
struct PackedBatch;
struct DecodeSlab;

// A linear layer: float32/bf16 weights, and optionally the same weights block-quantized for
// the CPU decode path (a handful of rows, no gradient). `int8_activations` picks that path's
// arithmetic (model/quantized.h).
struct Linear {
  at::Tensor weight, bias;
  std::shared_ptr<const QuantizedMatrix> quantized;
  at::Tensor operator()(const at::Tensor& x, bool int8_activations = false) const;
};

class LlamaModel {
 public:
  // `weights` uses Hugging Face names (model.layers.0.self_attn.q_proj.weight, ...);
  // `quantized` optionally holds some of the same matrices as GGUF blocks, by the same names.
  LlamaModel(LlamaConfig config, const std::unordered_map<std::string, at::Tensor>& weights,
             at::Device device, at::ScalarType dtype,
             const std::unordered_map<std::string, QuantizedWeight>& quantized = {});

  const LlamaConfig& config() const { return config_; }
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }
  at::TensorOptions options() const { return at::TensorOptions().device(device_).dtype(dtype_); }

  KVCache new_cache(int64_t batch, int64_t capacity) const;

  // The same model with its weights in `dtype`, on the same device: e.g. a bfloat16 twin that
  // trains a cartridge beside the float32 model that serves it. The block-quantized weights
  // stay only where they are used (CPU float32); tied embeddings stay tied.
  LlamaModel with_dtype(at::ScalarType dtype) const;

  // Whether decode steps on block-quantized CPU weights round activations to 8 bits
  // (llama.cpp's arithmetic, the default: several times faster) or keep them in float32
  // (results equal to transformers' on the dequantized weights, up to summation order).
  // Set it before generating; it has no effect without quantized weights.
  bool int8_activations() const { return int8_activations_; }
  void set_int8_activations(bool on) { int8_activations_ = on; }
  // Whether every matrix product of a forward without gradient runs on the block-quantized
  // kernels with int8 activations (CPU float32, every projection and the head quantized):
  // ATen's operators then carry only small elementwise work.
  bool products_on_quantized_kernels() const;

  // Final-norm hidden states [B, S, hidden]. With a cache, the new K/V are appended to it
  // and attention covers prefixes + cache; without one, prefixes + these tokens only
  // (the training path: differentiable with respect to the prefixes).
  at::Tensor forward_hidden(const ForwardBatch& batch, KVCache* cache) const;
  // Logits [..., vocab] from final hidden states, in float32.
  at::Tensor logits(const at::Tensor& hidden) const;
  // The same in the model's dtype, for a consumer that reads bfloat16 itself (the training loss).
  at::Tensor logits_in_model_dtype(const at::Tensor& hidden) const;
  // Logits [B, vocab] at each row's last valid new token.
  at::Tensor forward_last(const ForwardBatch& batch, KVCache* cache) const;
  // Logits [B, S, vocab] at every new position.
  at::Tensor forward(const ForwardBatch& batch, KVCache* cache) const;

  // The serving step: appends each sequence's new K/V to `pool` and returns float32 logits
  // [R, vocab], in order: num_new - logits_from rows for each sequence with `all_logits` set,
  // one at the last new token for each other sequence with `logits` set. Sequences with the
  // same prefix list attend to it together, reading it once per layer.
  at::Tensor forward_packed(const PackedBatch& batch, KVPool& pool) const;
  // A decode step at fixed shapes, for R one-token rows (a CUDA graph captures and replays
  // it): `inputs` [kDecodeInputs, R] int64 on the model's device (cartridges/kv_pool.h), each
  // row over `prefix_tokens` (P) padded keys of `slab` then `own_tokens` (L) padded pool slots.
  // Writes each row's new K/V to the pool and returns float32 logits [R, vocab]. Equal to
  // forward_packed on the same rows up to summation order: every row folds its prefixes.
  at::Tensor forward_fixed_decode(const at::Tensor& inputs, int64_t prefix_tokens, int64_t own_tokens,
                                  const DecodeSlab& slab, KVPool& pool) const;

  // KV of `tokens` [S] as a prefix (the prefix-from-text initialization of a cartridge); with
  // `queries`, also each layer's queries [H, S, D] after RoPE, from the same pass.
  KVPrefix prefix_from_tokens(const at::Tensor& tokens, std::vector<at::Tensor>* queries = nullptr) const;
  // x [H, S, D] rotated by RoPE at `positions` [S] (any integers; negative ones rotate back):
  // rotating keys stored at position i by p - i moves them to position p.
  at::Tensor rotate(const at::Tensor& x, const at::Tensor& positions) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    Linear qkv;                // q, k, v projections fused: [(H + 2 H_kv) D, hidden]
    at::Tensor q_norm, k_norm;  // Qwen3 only
    Linear o;
    Linear gate_up;            // gate and up fused: [2 I, hidden]
    Linear down;
  };

  // Everything in a layer but attention: shared by forward_hidden and forward_packed.
  struct Projections {
    at::Tensor q, k, v;  // [..., H, D], [..., H_kv, D], [..., H_kv, D] before RoPE
  };
  Projections project_qkv(const Layer& layer, const at::Tensor& x) const;
  at::Tensor mlp(const Layer& layer, const at::Tensor& x) const;
  at::Tensor apply(const Linear& linear, const at::Tensor& x) const { return linear(x, int8_activations_); }

  LlamaConfig config_;
  at::Device device_;
  at::ScalarType dtype_;
  at::Tensor embed_, final_norm_;
  Linear lm_head_;
  at::Tensor inv_freq_;  // [D/2] float32 RoPE frequencies
  std::vector<Layer> layers_;
  bool int8_activations_ = true;
};

}  // namespace cartridges
