// Python bindings: model.
#include <pybind11/stl.h>

#include "cartridges/compute.h"
#include "cartridges/model.h"
#include "common.h"

namespace cartridges::bindings {

namespace {

ForwardBatch make_batch(const at::Tensor& tokens, std::optional<std::vector<int64_t>> num_new,
                        std::optional<std::vector<PyPrefixList>> prefixes) {
  ForwardBatch batch;
  batch.tokens = tokens;
  if (num_new) batch.num_new = *num_new;
  if (prefixes) {
    for (const auto& row : *prefixes) batch.prefixes.push_back(to_const(row));
  }
  return batch;
}

// The model's config, KV prefixes (cartridges) and the per-sequence KV cache.
void bind_config_and_prefixes(py::module_& m) {
  py::class_<LlamaConfig>(m, "LlamaConfig")
      .def(py::init<>())
      .def_readwrite("vocab_size", &LlamaConfig::vocab_size)
      .def_readwrite("hidden_size", &LlamaConfig::hidden_size)
      .def_readwrite("intermediate_size", &LlamaConfig::intermediate_size)
      .def_readwrite("num_layers", &LlamaConfig::num_layers)
      .def_readwrite("num_heads", &LlamaConfig::num_heads)
      .def_readwrite("num_kv_heads", &LlamaConfig::num_kv_heads)
      .def_readwrite("head_dim", &LlamaConfig::head_dim)
      .def_readwrite("rms_norm_eps", &LlamaConfig::rms_norm_eps)
      .def_readwrite("rope_theta", &LlamaConfig::rope_theta)
      .def_readwrite("rope_type", &LlamaConfig::rope_type)
      .def_readwrite("rope_factor", &LlamaConfig::rope_factor)
      .def_readwrite("rope_low_freq_factor", &LlamaConfig::rope_low_freq_factor)
      .def_readwrite("rope_high_freq_factor", &LlamaConfig::rope_high_freq_factor)
      .def_readwrite("rope_original_max_position_embeddings", &LlamaConfig::rope_original_max_position_embeddings)
      .def_readwrite("attention_bias", &LlamaConfig::attention_bias)
      .def_readwrite("qk_norm", &LlamaConfig::qk_norm)
      .def_readwrite("tie_word_embeddings", &LlamaConfig::tie_word_embeddings)
      .def_readwrite("max_position_embeddings", &LlamaConfig::max_position_embeddings)
      .def("validate", &LlamaConfig::validate);

  py::class_<KVPrefix, std::shared_ptr<KVPrefix>>(
      m, "KVPrefix",
      "Per-layer keys/values [H_kv, P, D], keys after RoPE at 0..P-1; optionally per-layer float32 attention "
      "biases [H_kv, P] added to the logits of every query on these keys.")
      .def(py::init([](std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                       std::optional<std::vector<at::Tensor>> biases) {
             TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "KVPrefix: one key and one value per layer");
             for (size_t l = 0; l < keys.size(); ++l) {
               TORCH_CHECK(keys[l].dim() == 3 && keys[l].sizes() == values[l].sizes(),
                           "KVPrefix: layer ", l, " keys/values must both be [H_kv, P, D]");
               TORCH_CHECK(keys[l].size(1) == keys[0].size(1), "KVPrefix: every layer must have the same length");
             }
             std::vector<at::Tensor> bias_list = biases.value_or(std::vector<at::Tensor>{});
             TORCH_CHECK(bias_list.empty() || bias_list.size() == keys.size(), "KVPrefix: one bias per layer");
             for (size_t l = 0; l < bias_list.size(); ++l) {
               TORCH_CHECK(bias_list[l].dim() == 2 && bias_list[l].size(0) == keys[l].size(0) &&
                               bias_list[l].size(1) == keys[l].size(1) && bias_list[l].scalar_type() == at::kFloat,
                           "KVPrefix: layer ", l, " bias must be float32 [H_kv, P]");
             }
             return std::make_shared<KVPrefix>(KVPrefix{std::move(keys), std::move(values), std::move(bias_list)});
           }),
           py::arg("keys"), py::arg("values"), py::arg("biases") = py::none())
      .def_readonly("keys", &KVPrefix::keys)
      .def_readonly("values", &KVPrefix::values)
      .def_property_readonly(
          "biases", [](const KVPrefix& p) { return biases_or_none(p.biases); },
          "Per-layer attention biases [H_kv, P], or None.")
      .def_property_readonly("num_tokens", &KVPrefix::num_tokens)
      .def_property_readonly("nbytes", &KVPrefix::nbytes);

  py::class_<KVCache>(m, "KVCache")
      .def_property_readonly("batch", &KVCache::batch)
      .def_property_readonly("capacity", &KVCache::capacity)
      .def_readonly("lengths", &KVCache::lengths)
      .def_readonly("keys", &KVCache::keys)
      .def_readonly("values", &KVCache::values);
}

// The model: loading, forward, logits, prefixes from tokens.
void bind_llama_model(py::module_& m) {
  py::class_<LlamaModel, std::shared_ptr<LlamaModel>>(m, "LlamaModel")
      .def(py::init([](const LlamaConfig& config, const std::unordered_map<std::string, at::Tensor>& weights,
                       const std::string& device, const std::string& dtype,
                       const std::unordered_map<std::string, std::pair<std::string, at::Tensor>>& quantized) {
             std::unordered_map<std::string, QuantizedWeight> blocks;
             for (const auto& [name, entry] : quantized) blocks[name] = QuantizedWeight{entry.first, entry.second};
             py::gil_scoped_release release;
             return std::make_shared<LlamaModel>(config, weights, at::Device(device), parse_dtype(dtype), blocks);
           }),
           py::arg("config"), py::arg("weights"), py::arg("device") = "cpu", py::arg("dtype") = "float32",
           py::arg("quantized") = std::unordered_map<std::string, std::pair<std::string, at::Tensor>>{},
           "weights: float32 tensors by Hugging Face name; quantized: name -> (GGUF block format, uint8 "
           "[rows, row bytes]) for the CPU decode path.")
      .def_property_readonly("config", &LlamaModel::config)
      .def_property_readonly("device", [](const LlamaModel& m) { return m.device().str(); })
      .def_property_readonly("dtype", [](const LlamaModel& m) { return dtype_name(m.dtype()); })
      .def_property("int8_activations", &LlamaModel::int8_activations, &LlamaModel::set_int8_activations,
                    "Decode on block-quantized CPU weights with activations rounded to 8 bits (the default, "
                    "llama.cpp's arithmetic) or kept in float32 (transformers' results); set before generating.")
      .def(
          "with_dtype",
          [](const LlamaModel& m, const std::string& dtype) {
            return std::make_shared<LlamaModel>(m.with_dtype(parse_dtype(dtype)));
          },
          py::arg("dtype"),
          "The same model with its weights in `dtype` (\"float32\" or \"bfloat16\"), on the same device: "
          "e.g. a bfloat16 twin to train on beside the float32 model that serves.")
      .def("new_cache", &LlamaModel::new_cache, py::arg("batch"), py::arg("capacity"))
      .def(
          "forward",
          [](const LlamaModel& m, const at::Tensor& tokens, std::optional<std::vector<int64_t>> num_new,
             KVCache* cache, std::optional<std::vector<PyPrefixList>> prefixes, bool last_only) {
            auto batch = make_batch(tokens, std::move(num_new), std::move(prefixes));
            py::gil_scoped_release release;
            ComputeLock turn;
            return last_only ? m.forward_last(batch, cache) : m.forward(batch, cache);
          },
          py::arg("tokens"), py::arg("num_new") = py::none(), py::arg("cache") = nullptr,
          py::arg("prefixes") = py::none(), py::arg("last_only") = false,
          "Logits [B, S, V] (or [B, V] at each row's last token with last_only) for tokens [B, S].")
      .def(
          "forward_hidden",
          [](const LlamaModel& m, const at::Tensor& tokens, std::optional<std::vector<int64_t>> num_new,
             KVCache* cache, std::optional<std::vector<PyPrefixList>> prefixes, bool bfloat16_attention) {
            auto batch = make_batch(tokens, std::move(num_new), std::move(prefixes));
            batch.bfloat16_attention = bfloat16_attention;
            py::gil_scoped_release release;
            ComputeLock turn;
            return m.forward_hidden(batch, cache);
          },
          py::arg("tokens"), py::arg("num_new") = py::none(), py::arg("cache") = nullptr,
          py::arg("prefixes") = py::none(), py::arg("bfloat16_attention") = false,
          "The last layer's hidden states [B, S, hidden] for tokens [B, S]. With "
          "bfloat16_attention, a float32 model's attention behind the prefixes runs in bfloat16 where "
          "the CPU has AVX-512 BF16 (3-6x faster; no gradients).")
      .def("logits", &LlamaModel::logits, py::arg("hidden"), py::call_guard<py::gil_scoped_release, ComputeLock>())
      .def(
          "prefix_from_tokens",
          [](const LlamaModel& m, const at::Tensor& tokens) {
            py::gil_scoped_release release;
            ComputeLock turn;
            return std::make_shared<KVPrefix>(m.prefix_from_tokens(tokens));
          },
          py::arg("tokens"))
      .def(
          "queries_and_prefix",
          [](const LlamaModel& m, const at::Tensor& tokens) {
            py::gil_scoped_release release;
            ComputeLock turn;
            std::vector<at::Tensor> queries;
            auto prefix = std::make_shared<KVPrefix>(m.prefix_from_tokens(tokens, &queries));
            return std::make_pair(queries, prefix);
          },
          py::arg("tokens"),
          "Each layer's queries [heads, S, head_dim] after RoPE and the KV prefix of `tokens` [S], from one "
          "pass at positions 0..S-1 (what attention matching compacts).")
      .def("rotate", &LlamaModel::rotate, py::arg("x"), py::arg("positions"),
           py::call_guard<py::gil_scoped_release>(),
           "x [heads, S, head_dim] rotated by RoPE at `positions` [S]; keys at position i rotated by p - i are "
           "at position p.");
}

}  // namespace

void bind_model(py::module_& m) {
  bind_config_and_prefixes(m);
  bind_llama_model(m);
  m.def(
      "dequantize_weight",
      [](const std::string& format, const at::Tensor& data, int64_t in_features) {
        QuantizedWeight weight{format, data};
        py::gil_scoped_release release;
        return dequantize_weight(weight, in_features);
      },
      py::arg("format"), py::arg("data"), py::arg("in_features"),
      "float32 [rows, in_features] of a GGUF block-quantized matrix (format 'Q4_0', 'Q4_1' or 'Q8_0', data "
      "uint8 [rows, row bytes]), decoded on all threads: the values the CPU kernel multiplies by.");
}

}  // namespace cartridges::bindings
