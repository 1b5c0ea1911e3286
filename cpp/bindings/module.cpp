// The one pybind11 file: exposes the C++ core as `cartridges_core`. No logic lives here.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "cartridges/cartridge.h"
#include "cartridges/engine.h"
#include "cartridges/model.h"
#include "cartridges/store.h"

namespace py = pybind11;
using namespace cartridges;

namespace {

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw py::value_error("unsupported dtype '" + name + "' (float32, bfloat16 or float16)");
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return c10::toString(t);
  }
}

using PyPrefixList = std::vector<std::shared_ptr<KVPrefix>>;

PrefixList to_const(const PyPrefixList& list) { return PrefixList(list.begin(), list.end()); }

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

}  // namespace

PYBIND11_MODULE(cartridges_core, m) {
  m.doc() = "C++ core of cartridges: Llama-family forward with KV cache and prefixes, generation.";

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

  py::class_<KVPrefix, std::shared_ptr<KVPrefix>>(m, "KVPrefix",
                                                  "Per-layer keys/values [H_kv, P, D]; keys after RoPE at 0..P-1.")
      .def(py::init([](std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
             TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "KVPrefix: one key and one value per layer");
             for (size_t l = 0; l < keys.size(); ++l) {
               TORCH_CHECK(keys[l].dim() == 3 && keys[l].sizes() == values[l].sizes(),
                           "KVPrefix: layer ", l, " keys/values must both be [H_kv, P, D]");
               TORCH_CHECK(keys[l].size(1) == keys[0].size(1), "KVPrefix: every layer must have the same length");
             }
             return std::make_shared<KVPrefix>(KVPrefix{std::move(keys), std::move(values)});
           }),
           py::arg("keys"), py::arg("values"))
      .def_readonly("keys", &KVPrefix::keys)
      .def_readonly("values", &KVPrefix::values)
      .def_property_readonly("num_tokens", &KVPrefix::num_tokens)
      .def_property_readonly("nbytes", &KVPrefix::nbytes);

  py::class_<KVCache>(m, "KVCache")
      .def_property_readonly("batch", &KVCache::batch)
      .def_property_readonly("capacity", &KVCache::capacity)
      .def_readonly("lengths", &KVCache::lengths)
      .def_readonly("keys", &KVCache::keys)
      .def_readonly("values", &KVCache::values)
      .def("keep_rows", &KVCache::keep_rows);

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
      .def("new_cache", &LlamaModel::new_cache, py::arg("batch"), py::arg("capacity"))
      .def(
          "forward",
          [](const LlamaModel& m, const at::Tensor& tokens, std::optional<std::vector<int64_t>> num_new,
             KVCache* cache, std::optional<std::vector<PyPrefixList>> prefixes, bool last_only) {
            auto batch = make_batch(tokens, std::move(num_new), std::move(prefixes));
            py::gil_scoped_release release;
            return last_only ? m.forward_last(batch, cache) : m.forward(batch, cache);
          },
          py::arg("tokens"), py::arg("num_new") = py::none(), py::arg("cache") = nullptr,
          py::arg("prefixes") = py::none(), py::arg("last_only") = false,
          "Logits [B, S, V] (or [B, V] at each row's last token with last_only) for tokens [B, S].")
      .def(
          "forward_hidden",
          [](const LlamaModel& m, const at::Tensor& tokens, std::optional<std::vector<int64_t>> num_new,
             KVCache* cache, std::optional<std::vector<PyPrefixList>> prefixes) {
            auto batch = make_batch(tokens, std::move(num_new), std::move(prefixes));
            py::gil_scoped_release release;
            return m.forward_hidden(batch, cache);
          },
          py::arg("tokens"), py::arg("num_new") = py::none(), py::arg("cache") = nullptr,
          py::arg("prefixes") = py::none())
      .def("logits", &LlamaModel::logits, py::arg("hidden"), py::call_guard<py::gil_scoped_release>())
      .def(
          "prefix_from_tokens",
          [](const LlamaModel& m, const at::Tensor& tokens) {
            py::gil_scoped_release release;
            return std::make_shared<KVPrefix>(m.prefix_from_tokens(tokens));
          },
          py::arg("tokens"));

  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init([](double temperature, double top_p, int64_t top_k, int64_t seed, int64_t max_new_tokens,
                       std::vector<int64_t> stop_token_ids) {
             return SamplingParams{temperature, top_p, top_k, seed, max_new_tokens, std::move(stop_token_ids)};
           }),
           py::arg("temperature") = 0.0, py::arg("top_p") = 1.0, py::arg("top_k") = 0, py::arg("seed") = -1,
           py::arg("max_new_tokens") = 256, py::arg("stop_token_ids") = std::vector<int64_t>{})
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids);

  py::class_<Sampler>(m, "Sampler")
      .def(py::init<const SamplingParams&>())
      .def("sample", &Sampler::sample);
  m.def("filter_top_k", &filter_top_k);
  m.def("filter_top_p", &filter_top_p);

  m.def(
      "generate",
      [](const LlamaModel& model, const std::vector<std::vector<int64_t>>& prompts,
         const std::vector<SamplingParams>& params, std::optional<std::vector<PyPrefixList>> prefixes,
         std::optional<std::function<bool(int64_t, int64_t)>> on_token) {
        TORCH_CHECK(params.size() == prompts.size(), "generate: one SamplingParams per prompt");
        TORCH_CHECK(!prefixes || prefixes->size() == prompts.size(), "generate: one prefix list per prompt");
        std::vector<GenerationRequest> requests(prompts.size());
        for (size_t i = 0; i < prompts.size(); ++i) {
          requests[i] = {prompts[i], params[i], prefixes ? to_const((*prefixes)[i]) : PrefixList{}};
        }
        TokenCallback callback;
        if (on_token) {
          // The callback is Python: take the GIL around each call only.
          callback = [fn = *on_token](int64_t request, int64_t token) {
            py::gil_scoped_acquire acquire;
            return fn(request, token);
          };
        }
        std::vector<GenerationResult> results;
        {
          py::gil_scoped_release release;
          results = generate(model, requests, callback);
        }
        py::list out;
        for (auto& r : results) out.append(py::make_tuple(r.tokens, r.finish_reason));
        return out;
      },
      py::arg("model"), py::arg("prompts"), py::arg("params"), py::arg("prefixes") = py::none(),
      py::arg("on_token") = py::none(),
      "Generates for all prompts as one batch; returns [(tokens, finish_reason)]. on_token(i, token) -> bool is "
      "called per token; False cancels request i.");

  // ---- store ----
  // Errors: StoreError (RuntimeError) and its subclasses NotFoundError, ConflictError, CorruptError.
  // Translators run newest first, so the subclasses are registered after their base.
  auto& store_error = py::register_exception<StoreError>(m, "StoreError", PyExc_RuntimeError);
  py::register_exception<NotFoundError>(m, "NotFoundError", store_error.ptr());
  py::register_exception<ConflictError>(m, "ConflictError", store_error.ptr());
  py::register_exception<CorruptError>(m, "CorruptError", store_error.ptr());

  py::class_<Owner>(m, "Owner", "Who is asking: a user, or the admin (acts on every user's objects).")
      .def(py::init([](int64_t user_id, bool admin) { return Owner{user_id, admin}; }), py::arg("user_id"),
           py::arg("admin") = false)
      .def_readonly("user_id", &Owner::user_id)
      .def_readonly("admin", &Owner::admin)
      .def("__repr__", [](const Owner& o) {
        return "Owner(user_id=" + std::to_string(o.user_id) + (o.admin ? ", admin=True)" : ")");
      });

  py::class_<User>(m, "User")
      .def_readonly("id", &User::id)
      .def_readonly("name", &User::name)
      .def_readonly("created_at", &User::created_at);

  py::class_<ApiKeyInfo>(m, "ApiKeyInfo")
      .def_readonly("id", &ApiKeyInfo::id)
      .def_readonly("user_id", &ApiKeyInfo::user_id)
      .def_readonly("user_name", &ApiKeyInfo::user_name)
      .def_readonly("hint", &ApiKeyInfo::hint)
      .def_readonly("created_at", &ApiKeyInfo::created_at)
      .def_readonly("revoked_at", &ApiKeyInfo::revoked_at);

  py::class_<FileRecord>(m, "FileRecord")
      .def_readonly("id", &FileRecord::id)
      .def_readonly("owner_id", &FileRecord::owner_id)
      .def_readonly("filename", &FileRecord::filename)
      .def_readonly("purpose", &FileRecord::purpose)
      .def_readonly("bytes", &FileRecord::bytes)
      .def_readonly("created_at", &FileRecord::created_at)
      .def_readonly("status", &FileRecord::status)
      .def_readonly("status_details", &FileRecord::status_details);

  py::class_<FilePage>(m, "FilePage")
      .def_readonly("data", &FilePage::data)
      .def_readonly("has_more", &FilePage::has_more);

  py::class_<BlobWriter>(m, "BlobWriter", "A blob being written to a temporary file; Store.create_file commits it.")
      .def(
          "write",
          [](BlobWriter& w, py::buffer data) {
            py::buffer_info info = data.request();
            if (info.ndim > 1 || (info.ndim == 1 && info.strides[0] != info.itemsize)) {
              throw py::value_error("BlobWriter.write: a contiguous bytes-like object");
            }
            py::gil_scoped_release release;
            w.write(static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
          },
          py::arg("data"))
      .def("abort", &BlobWriter::abort, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("bytes", &BlobWriter::bytes)
      .def_property_readonly("open", &BlobWriter::open);

  py::class_<Store, std::shared_ptr<Store>>(m, "Store", "SQLite metadata + blob directory; every call takes the owner.")
      .def(py::init([](const std::string& data_dir, bool sync, bool check_at_open) {
             StoreOptions options;
             options.data_dir = data_dir;
             options.sync = sync;
             options.check_at_open = check_at_open;
             py::gil_scoped_release release;
             return std::make_shared<Store>(options);
           }),
           py::arg("data_dir"), py::arg("sync") = true, py::arg("check_at_open") = true)
      .def("close", &Store::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("data_dir", [](const Store& s) { return s.options().data_dir; })
      .def_property_readonly("schema_version", &Store::schema_version)
      .def_property_readonly("swept_at_open", &Store::swept_at_open)
      .def("create_user", &Store::create_user, py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def("find_user", &Store::find_user, py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def("list_users", &Store::list_users, py::call_guard<py::gil_scoped_release>())
      .def("add_key", &Store::add_key, py::arg("user_id"), py::arg("key_hash"), py::arg("hint"),
           py::call_guard<py::gil_scoped_release>())
      .def("user_for_key", &Store::user_for_key, py::arg("key_hash"), py::call_guard<py::gil_scoped_release>())
      .def("list_keys", &Store::list_keys, py::call_guard<py::gil_scoped_release>())
      .def("revoke_key", &Store::revoke_key, py::arg("key_id"), py::call_guard<py::gil_scoped_release>())
      .def("begin_blob", &Store::begin_blob, py::call_guard<py::gil_scoped_release>())
      .def("create_file", &Store::create_file, py::arg("owner"), py::arg("content"), py::arg("filename"),
           py::arg("purpose"), py::call_guard<py::gil_scoped_release>())
      .def("get_file", &Store::get_file, py::arg("owner"), py::arg("file_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "list_files",
          [](Store& s, const Owner& owner, std::optional<std::string> purpose, std::optional<std::string> status,
             std::optional<std::string> after, int64_t limit, bool descending) {
            FileQuery q{std::move(purpose), std::move(status), std::move(after), limit, descending};
            py::gil_scoped_release release;
            return s.list_files(owner, q);
          },
          py::arg("owner"), py::kw_only(), py::arg("purpose") = py::none(), py::arg("status") = py::none(),
          py::arg("after") = py::none(), py::arg("limit") = 10000, py::arg("descending") = true)
      .def("delete_file", &Store::delete_file, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_file_processed", &Store::set_file_processed, py::arg("owner"), py::arg("file_id"),
           py::arg("text") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("set_file_error", &Store::set_file_error, py::arg("owner"), py::arg("file_id"), py::arg("details"),
           py::call_guard<py::gil_scoped_release>())
      .def("file_content_path", &Store::file_content_path, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("verify_file", &Store::verify_file, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "file_text",
          [](Store& s, const Owner& owner, const std::string& id) {
            std::string text;
            {
              py::gil_scoped_release release;
              text = s.file_text(owner, id);
            }
            return py::str(text);  // stored text is UTF-8
          },
          py::arg("owner"), py::arg("file_id"));

  // ---- cartridge training ----
  py::class_<CartridgeParams>(m, "CartridgeParams",
                              "Trainable prefix: float32 frozen and trainable keys/values per layer [H_kv, n, D].")
      .def(py::init(&CartridgeParams::from_prefix), py::arg("prefix"), py::arg("num_frozen") = 1)
      .def(py::init([](std::vector<at::Tensor> fk, std::vector<at::Tensor> fv, std::vector<at::Tensor> tk,
                       std::vector<at::Tensor> tv) {
             TORCH_CHECK(!tk.empty() && fk.size() == tk.size() && fv.size() == tk.size() && tv.size() == tk.size(),
                         "CartridgeParams: one frozen and one trainable key/value tensor per layer");
             CartridgeParams p;
             for (size_t l = 0; l < tk.size(); ++l) {
               p.frozen_keys.push_back(fk[l].detach().to(at::kFloat).contiguous());
               p.frozen_values.push_back(fv[l].detach().to(at::kFloat).contiguous());
               p.trainable_keys.push_back(tk[l].detach().to(at::kFloat).clone().set_requires_grad(true));
               p.trainable_values.push_back(tv[l].detach().to(at::kFloat).clone().set_requires_grad(true));
             }
             return p;
           }),
           py::arg("frozen_keys"), py::arg("frozen_values"), py::arg("trainable_keys"), py::arg("trainable_values"))
      .def_readonly("frozen_keys", &CartridgeParams::frozen_keys)
      .def_readonly("frozen_values", &CartridgeParams::frozen_values)
      .def_readonly("trainable_keys", &CartridgeParams::trainable_keys)
      .def_readonly("trainable_values", &CartridgeParams::trainable_values)
      .def_property_readonly("num_tokens", &CartridgeParams::num_tokens)
      .def_property_readonly("num_frozen", &CartridgeParams::num_frozen)
      .def(
          "to_prefix",
          [](const CartridgeParams& p, const std::string& dtype, const std::string& device) {
            return std::make_shared<KVPrefix>(p.to_prefix(parse_dtype(dtype), at::Device(device), /*detach=*/true));
          },
          py::arg("dtype") = "float32", py::arg("device") = "cpu", "A detached serving copy as a KVPrefix.");

  py::class_<TrainingData>(m, "TrainingData")
      .def(py::init([](at::Tensor tokens, at::Tensor lengths, at::Tensor target_mask, at::Tensor topk_ids,
                       at::Tensor topk_logprobs) {
             return TrainingData{tokens, lengths, target_mask, topk_ids, topk_logprobs};
           }),
           py::arg("tokens"), py::arg("lengths"), py::arg("target_mask"), py::arg("topk_ids"),
           py::arg("topk_logprobs"))
      .def_readonly("tokens", &TrainingData::tokens)
      .def_readonly("lengths", &TrainingData::lengths)
      .def_readonly("target_mask", &TrainingData::target_mask)
      .def_readonly("topk_ids", &TrainingData::topk_ids)
      .def_readonly("topk_logprobs", &TrainingData::topk_logprobs)
      .def("validate", &TrainingData::validate, py::arg("vocab_size"));

  m.def("distillation_loss_sum", &distillation_loss_sum, py::arg("model"), py::arg("params"), py::arg("data"),
        py::arg("rows"), py::call_guard<py::gil_scoped_release>(),
        "(loss summed over the rows' targets, differentiable w.r.t. params' trainable tensors; target count).");

  py::class_<Adam>(m, "Adam")
      .def(py::init([](std::vector<at::Tensor> params, double lr, double beta1, double beta2, double eps) {
             return Adam(std::move(params), AdamOptions{lr, beta1, beta2, eps});
           }),
           py::arg("params"), py::arg("lr") = 2e-2, py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
           py::arg("eps") = 1e-8)
      .def("step", &Adam::step, py::arg("lr"))
      .def("zero_grad", &Adam::zero_grad)
      .def_property_readonly("steps", &Adam::steps);

  py::class_<TrainOptions>(m, "TrainOptions")
      .def(py::init<>())
      .def_property(
          "lr", [](const TrainOptions& o) { return o.adam.lr; }, [](TrainOptions& o, double v) { o.adam.lr = v; })
      .def_readwrite("epochs", &TrainOptions::epochs)
      .def_readwrite("batch_size", &TrainOptions::batch_size)
      .def_readwrite("grad_accum", &TrainOptions::grad_accum)
      .def_readwrite("cosine", &TrainOptions::cosine)
      .def_readwrite("seed", &TrainOptions::seed)
      .def_readwrite("checkpoint_path", &TrainOptions::checkpoint_path)
      .def_readwrite("checkpoint_every", &TrainOptions::checkpoint_every)
      .def_readwrite("resume", &TrainOptions::resume)
      .def("total_steps", &TrainOptions::total_steps, py::arg("num_conversations"));

  py::class_<TrainProgress>(m, "TrainProgress")
      .def_readonly("step", &TrainProgress::step)
      .def_readonly("total", &TrainProgress::total)
      .def_readonly("loss", &TrainProgress::loss)
      .def_readonly("lr", &TrainProgress::lr);

  py::class_<TrainResult>(m, "TrainResult")
      .def_readonly("steps", &TrainResult::steps)
      .def_readonly("cancelled", &TrainResult::cancelled)
      .def_readonly("losses", &TrainResult::losses);

  py::class_<CancelToken, std::shared_ptr<CancelToken>>(m, "CancelToken")
      .def(py::init<>())
      .def("cancel", [](CancelToken& t) { t.requested = true; })
      .def_property_readonly("cancelled", [](const CancelToken& t) { return t.requested.load(); });

  m.def(
      "train_cartridge",
      [](const LlamaModel& model, CartridgeParams& params, const TrainingData& data, const TrainOptions& options,
         std::optional<py::function> on_progress, std::shared_ptr<CancelToken> cancel) {
        ProgressCallback callback;
        if (on_progress) {
          callback = [fn = *on_progress](const TrainProgress& p) {
            py::gil_scoped_acquire acquire;
            py::object r = fn(p);
            return r.is_none() || r.cast<bool>();  // None (no return value) goes on
          };
        }
        py::gil_scoped_release release;
        return train_cartridge(model, params, data, options, callback, cancel ? &cancel->requested : nullptr);
      },
      py::arg("model"), py::arg("params"), py::arg("data"), py::arg("options"), py::arg("on_progress") = py::none(),
      py::arg("cancel") = nullptr,
      "Trains params in place with the GIL released. on_progress(TrainProgress) returning False cancels.");
}
