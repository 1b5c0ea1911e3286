// Python bindings: training.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "cartridges/cartridge.h"
#include "cartridges/compute.h"
#include "common.h"

namespace cartridges::bindings {

namespace {

// The trainable prefix, training data and the distillation loss.
void bind_cartridge_params_and_data(py::module_& m) {
  py::class_<CartridgeParams>(m, "CartridgeParams",
                              "Trainable prefix: float32 frozen and trainable keys/values per layer [H_kv, n, D].")
      .def(py::init(&CartridgeParams::from_prefix), py::arg("prefix"), py::arg("num_frozen") = 1)
      .def(py::init([](std::vector<at::Tensor> fk, std::vector<at::Tensor> fv, std::vector<at::Tensor> tk,
                       std::vector<at::Tensor> tv, std::optional<std::vector<at::Tensor>> biases) {
             TORCH_CHECK(!tk.empty() && fk.size() == tk.size() && fv.size() == tk.size() && tv.size() == tk.size(),
                         "CartridgeParams: one frozen and one trainable key/value tensor per layer");
             CartridgeParams p;
             for (size_t l = 0; l < tk.size(); ++l) {
               p.frozen_keys.push_back(fk[l].detach().to(at::kFloat).contiguous());
               p.frozen_values.push_back(fv[l].detach().to(at::kFloat).contiguous());
               p.trainable_keys.push_back(tk[l].detach().to(at::kFloat).clone().set_requires_grad(true));
               p.trainable_values.push_back(tv[l].detach().to(at::kFloat).clone().set_requires_grad(true));
             }
             for (const auto& b : biases.value_or(std::vector<at::Tensor>{})) {
               p.biases.push_back(b.detach().to(at::kFloat).contiguous());
             }
             TORCH_CHECK(p.biases.empty() || p.biases.size() == tk.size(), "CartridgeParams: one bias per layer");
             for (size_t l = 0; l < p.biases.size(); ++l) {
               TORCH_CHECK(p.biases[l].dim() == 2 && p.biases[l].size(0) == tk[l].size(0) &&
                               p.biases[l].size(1) == fk[l].size(1) + tk[l].size(1),
                           "CartridgeParams: layer ", l, " bias must be [H_kv, P]");
             }
             return p;
           }),
           py::arg("frozen_keys"), py::arg("frozen_values"), py::arg("trainable_keys"), py::arg("trainable_values"),
           py::arg("biases") = py::none())
      .def_readonly("frozen_keys", &CartridgeParams::frozen_keys)
      .def_readonly("frozen_values", &CartridgeParams::frozen_values)
      .def_readonly("trainable_keys", &CartridgeParams::trainable_keys)
      .def_readonly("trainable_values", &CartridgeParams::trainable_values)
      .def_property_readonly(
          "biases", [](const CartridgeParams& p) { return biases_or_none(p.biases); },
          "Per-layer attention biases [H_kv, P] (fixed, not trained), or None.")
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

  m.def(
      "distillation_loss_sum",
      [](const LlamaModel& model, const CartridgeParams& params, const TrainingData& data,
         const std::vector<int64_t>& rows, std::shared_ptr<KVPrefix> companion, int64_t companion_every) {
        return distillation_loss_sum(model, params, data, rows, companion, companion_every);
      },
      py::arg("model"), py::arg("params"), py::arg("data"),
        py::arg("rows"), py::arg("companion") = nullptr, py::arg("companion_every") = 0,
        py::call_guard<py::gil_scoped_release, ComputeLock>(),
        "(loss summed over the rows' targets, differentiable w.r.t. params' trainable tensors; target count). "
        "Rows r with r % companion_every == 0 have `companion` in front of the cartridge.");
}

// Adam, the training loop's options, its progress and result.
void bind_optimizer_and_options(py::module_& m) {
  py::class_<Adam>(m, "Adam")
      .def(py::init([](std::vector<at::Tensor> params, double lr, double beta1, double beta2, double eps,
                       double anchor, std::vector<double> lr_scales, std::vector<at::Tensor> channel_scales) {
             return Adam(std::move(params), AdamOptions{lr, beta1, beta2, eps, anchor}, std::move(lr_scales),
                         std::move(channel_scales));
           }),
           py::arg("params"), py::arg("lr") = 2e-2, py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
           py::arg("eps") = 1e-8, py::arg("anchor") = 0.0, py::arg("lr_scales") = std::vector<double>{},
           py::arg("channel_scales") = std::vector<at::Tensor>{})
      .def("step", &Adam::step, py::arg("lr"))
      .def("zero_grad", &Adam::zero_grad)
      .def_property_readonly("steps", &Adam::steps);

  py::class_<TrainOptions>(m, "TrainOptions")
      .def(py::init<>())
      .def_property(
          "learning_rate", [](const TrainOptions& o) { return o.adam.lr; },
          [](TrainOptions& o, double v) { o.adam.lr = v; }, "see TrainConfig.learning_rate")
      .def_property(
          "anchor", [](const TrainOptions& o) { return o.adam.anchor; },
          [](TrainOptions& o, double v) { o.adam.anchor = v; }, "see TrainConfig.anchor")
      .def_readwrite("epochs", &TrainOptions::epochs)
      .def_readwrite("batch_size", &TrainOptions::batch_size)
      .def_readwrite("grad_accum", &TrainOptions::grad_accum)
      .def_readwrite("cosine", &TrainOptions::cosine)
      .def_readwrite("warmup", &TrainOptions::warmup, "see TrainConfig.warmup")
      .def_readwrite("layer_scaled_lr", &TrainOptions::layer_scaled_lr, "see TrainConfig.layer_scaled_lr")
      .def_readwrite("channel_scaled_lr", &TrainOptions::channel_scaled_lr, "see TrainConfig.channel_scaled_lr")
      .def_readwrite("seed", &TrainOptions::seed)
      .def_property(
          "loss_weighting", [](const TrainOptions& o) { return std::string(loss_weighting_name(o.loss_weighting)); },
          [](TrainOptions& o, const std::string& name) { o.loss_weighting = parse_loss_weighting(name); },
          "How a step's loss is averaged: \"step\", \"token\" or \"row\" (see TrainConfig.loss_weighting).")
      .def_readwrite("checkpoint_path", &TrainOptions::checkpoint_path)
      .def_readwrite("checkpoint_every", &TrainOptions::checkpoint_every)
      .def_readwrite("resume", &TrainOptions::resume)
      .def_property(
          "companion", [](const TrainOptions& o) { return std::const_pointer_cast<KVPrefix>(o.companion); },
          [](TrainOptions& o, std::shared_ptr<KVPrefix> p) { o.companion = std::move(p); },
          "a prefix put in front of the cartridge for every companion_every-th conversation (None: never)")
      .def_readwrite("companion_every", &TrainOptions::companion_every)
      .def("total_steps", &TrainOptions::total_steps, py::arg("num_conversations"))
      .def("lr_at", &TrainOptions::lr_at, py::arg("step"), py::arg("total"),
           "the learning rate of step `step` (0-based) of a run of `total` steps: warmup, then cosine");

  py::class_<TrainProgress>(m, "TrainProgress")
      .def_readonly("step", &TrainProgress::step)
      .def_readonly("total", &TrainProgress::total)
      .def_readonly("loss", &TrainProgress::loss)
      .def_readonly("lr", &TrainProgress::lr);

  py::class_<TrainResult>(m, "TrainResult")
      .def_readonly("steps", &TrainResult::steps)
      .def_readonly("cancelled", &TrainResult::cancelled)
      .def_readonly("losses", &TrainResult::losses);
}

// Cancellation, the training loop, and what it derives (scales, order, length groups).
void bind_training_loop(py::module_& m) {
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

  m.def("layer_lr_scales", &layer_lr_scales, py::arg("params"),
        "Per parameter of params.parameters(): its layer's RMS over the RMS of all keys (or values).");
  m.def("channel_lr_scales", &channel_lr_scales, py::arg("params"),
        "Per parameter of params.parameters(): a [H_kv, 1, D] tensor, each channel's RMS over the trainable "
        "tokens over the RMS of all keys (or values).");

  m.def("training_order", &training_order, py::arg("n"), py::arg("seed"), py::arg("epoch"),
        "The order in which epoch `epoch` of a run with `seed` takes n conversations.");

  m.def(
      "length_groups",
      [](const std::vector<int64_t>& lengths, int64_t overhead) {
        std::vector<int64_t> rows(lengths.size());
        for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>(i);
        return length_groups(rows, at::tensor(lengths, at::kLong), overhead);
      },
      py::arg("lengths"), py::arg("overhead") = kLengthGroupOverhead,
      "Row indices split into groups of similar length for padded forwards: the cheapest split of the rows "
      "sorted by length when a group costs its rows times its longest row plus `overhead`.");
  m.def(
      "length_group_overhead", [](const std::string& device) { return length_group_overhead(c10::Device(device)); },
      py::arg("device"),
      "What a forward costs beyond its rows on `device` (\"cpu\", \"cuda\", ...), in padded row tokens: the "
      "`overhead` of length_groups, larger on a GPU, where a small forward's cost is its kernel launches.");
}

}  // namespace

void bind_training(py::module_& m) {
  bind_cartridge_params_and_data(m);
  bind_optimizer_and_options(m);
  bind_training_loop(m);
}

}  // namespace cartridges::bindings
