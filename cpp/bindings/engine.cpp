// Python bindings: sampling and the serving engine.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "cartridges/engine.h"
#include "common.h"

namespace cartridges::bindings {

namespace {

// Typed errors, sampling, priorities and composition.
void bind_sampling_and_composition(py::module_& m) {
  // Typed errors: the server answers them with 400 context_length_exceeded, 429, 503.
  py::register_exception<ContextLengthError>(m, "ContextLengthError", PyExc_ValueError);
  py::register_exception<EngineBusyError>(m, "EngineBusyError", PyExc_RuntimeError);
  py::register_exception<CacheFullError>(m, "CacheFullError", PyExc_RuntimeError);
  py::register_exception<EngineStoppedError>(m, "EngineStoppedError", PyExc_RuntimeError);

  const SamplingParams defaults;  // the one set of sampling defaults, SamplingParams's own
  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init([](double temperature, double top_p, int64_t top_k, int64_t seed, int64_t max_new_tokens,
                       std::vector<int64_t> stop_token_ids, int64_t logprobs, std::map<int64_t, double> logit_bias) {
             return SamplingParams{temperature,    top_p,    top_k, seed, max_new_tokens, std::move(stop_token_ids),
                                   logprobs,       std::move(logit_bias)};
           }),
           py::arg("temperature") = defaults.temperature, py::arg("top_p") = defaults.top_p,
           py::arg("top_k") = defaults.top_k, py::arg("seed") = defaults.seed,
           py::arg("max_new_tokens") = defaults.max_new_tokens, py::arg("stop_token_ids") = defaults.stop_token_ids,
           py::arg("logprobs") = defaults.logprobs, py::arg("logit_bias") = defaults.logit_bias)
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("logprobs", &SamplingParams::logprobs)
      .def_readwrite("logit_bias", &SamplingParams::logit_bias);

  py::class_<Sampler>(m, "Sampler")
      .def(py::init<const SamplingParams&>())
      .def("sample", &Sampler::sample);
  m.def("filter_top_k", &filter_top_k);
  m.def("filter_top_p", &filter_top_p);
  m.def("apply_logit_bias", &apply_logit_bias, py::arg("logits"), py::arg("bias"));

  py::enum_<Priority>(m, "Priority")
      .value("INTERACTIVE", Priority::kInteractive)
      .value("BACKGROUND", Priority::kBackground);

  py::enum_<Composition>(m, "Composition", "How several cartridges of one request are composed.")
      .value("CONCATENATE", Composition::kConcatenate)
      .value("MIXTURE", Composition::kMixture)
      .value("ROUTE", Composition::kRoute);
  m.def("tokens_in_front", &tokens_in_front, py::arg("cartridge_tokens"), py::arg("composition"),
        "Context positions cartridges of these lengths take in front of a prompt when composed so: their sum, or "
        "for a mixture or a route of two or more the longest.");
}

// The engine's options, events and statistics, and the cartridge cache.
void bind_engine_records(py::module_& m) {
  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("kv_tokens", &EngineOptions::kv_tokens)
      .def_readwrite("max_running", &EngineOptions::max_running)
      .def_readwrite("prefill_tokens_per_step", &EngineOptions::prefill_tokens_per_step)
      .def_readwrite("max_waiting", &EngineOptions::max_waiting)
      .def_readwrite("cartridge_cache_bytes", &EngineOptions::cartridge_cache_bytes)
      .def_readwrite("num_threads", &EngineOptions::num_threads)
      .def_readwrite("cuda_graphs", &EngineOptions::cuda_graphs)
      .def_readwrite("fixed_shape_decode", &EngineOptions::fixed_shape_decode);

  py::class_<Event>(m, "Event")
      .def_readonly("request", &Event::request)
      .def_property_readonly("finished", [](const Event& e) { return e.kind == Event::Kind::kFinished; })
      .def_readonly("token", &Event::token)
      .def_readonly("logprob", &Event::logprob)
      .def_readonly("top_ids", &Event::top_ids)
      .def_readonly("top_logprobs", &Event::top_logprobs)
      .def_readonly("finish_reason", &Event::finish_reason)
      .def_readonly("error", &Event::error);

  py::class_<CartridgeCacheStats>(m, "CartridgeCacheStats")
      .def_readonly("entries", &CartridgeCacheStats::entries)
      .def_readonly("bytes", &CartridgeCacheStats::bytes)
      .def_readonly("budget_bytes", &CartridgeCacheStats::budget_bytes)
      .def_readonly("hits", &CartridgeCacheStats::hits)
      .def_readonly("misses", &CartridgeCacheStats::misses)
      .def_readonly("loads", &CartridgeCacheStats::loads)
      .def_readonly("evictions", &CartridgeCacheStats::evictions);

  py::class_<EngineStats>(m, "EngineStats")
      .def_readonly("running", &EngineStats::running)
      .def_readonly("waiting", &EngineStats::waiting)
      .def_readonly("kv_tokens_used", &EngineStats::kv_tokens_used)
      .def_readonly("kv_tokens_total", &EngineStats::kv_tokens_total)
      .def_readonly("kv_bytes", &EngineStats::kv_bytes)
      .def_readonly("kv_compactions", &EngineStats::kv_compactions)
      .def_readonly("fixed_shape_steps", &EngineStats::fixed_shape_steps)
      .def_readonly("cuda_graph_captures", &EngineStats::cuda_graph_captures)
      .def_readonly("steps", &EngineStats::steps)
      .def_readonly("prompt_tokens", &EngineStats::prompt_tokens)
      .def_readonly("generated_tokens", &EngineStats::generated_tokens)
      .def_readonly("finished", &EngineStats::finished)
      .def_readonly("cancelled", &EngineStats::cancelled)
      .def_readonly("cartridges", &EngineStats::cartridges);

  py::class_<CartridgeCache>(m, "CartridgeCache", "Cartridges by id under a byte budget; LRU eviction of idle ones.")
      .def("get", [](CartridgeCache& c, const std::string& id) { return std::const_pointer_cast<KVPrefix>(c.get(id)); })
      .def("contains", &CartridgeCache::contains)
      .def("put", [](CartridgeCache& c, const std::string& id, std::shared_ptr<KVPrefix> p) { c.put(id, std::move(p)); },
           py::arg("id"), py::arg("prefix"))
      .def("remove", &CartridgeCache::remove)
      .def("ids", &CartridgeCache::ids)
      .def("stats", &CartridgeCache::stats);
}

// The engine itself.
void bind_engine_class(py::module_& m) {
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", "The serving engine: one compute thread, many requests.")
      .def(py::init([](std::shared_ptr<LlamaModel> model, const EngineOptions& options) {
             py::gil_scoped_release release;
             return std::make_shared<Engine>(std::move(model), options);
           }),
           py::arg("model"), py::arg_v("options", EngineOptions{}, "EngineOptions()"))
      .def(
          "submit",
          [](Engine& e, std::vector<int64_t> prompt, const PyPrefixList& prefixes, const SamplingParams& params,
             Priority priority, Composition composition, int64_t weigh_from) {
            Request r{std::move(prompt), to_const(prefixes), params, priority, composition, weigh_from};
            py::gil_scoped_release release;
            return e.submit(std::move(r));
          },
          py::arg("prompt"), py::arg("prefixes"), py::arg("params"), py::arg("priority") = Priority::kInteractive,
          py::arg("composition") = Composition::kMixture, py::arg("weigh_from") = 0)
      .def(
          "submit_all",
          [](Engine& e, std::vector<std::tuple<std::vector<int64_t>, PyPrefixList, SamplingParams, int64_t>> requests,
             Priority priority, Composition composition) {
            std::vector<Request> rs;
            for (auto& [prompt, prefixes, params, weigh_from] : requests) {
              rs.push_back({prompt, to_const(prefixes), params, priority, composition, weigh_from});
            }
            py::gil_scoped_release release;
            return e.submit_all(std::move(rs));
          },
          py::arg("requests"), py::arg("priority") = Priority::kInteractive,
          py::arg("composition") = Composition::kMixture,
          "Queues [(prompt, prefixes, params, weigh_from)] at once (all or none); returns their ids.")
      .def("cancel", &Engine::cancel, py::arg("id"), py::call_guard<py::gil_scoped_release>())
      .def("poll", &Engine::poll, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
           "Events of finished steps (waits up to timeout for the first).")
      .def("events_fd", &Engine::events_fd,
           "A file descriptor readable when a step publishes events (read 8 bytes, then poll(0)); "
           "-1 without eventfd.")
      .def("stats", &Engine::stats, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("cartridges", &Engine::cartridges, py::return_value_policy::reference_internal)
      .def_property_readonly("options", &Engine::options)
      .def_property_readonly("running", &Engine::running)
      .def_property_readonly("drained", &Engine::drained,
                             "True once shut down and every event has been taken by poll().")
      .def_property("num_threads", &Engine::num_threads, &Engine::set_num_threads,
                    "Intra-op threads of the compute thread; a new value applies from the next step.")
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void bind_engine(py::module_& m) {
  bind_sampling_and_composition(m);
  bind_engine_records(m);
  bind_engine_class(m);
}

}  // namespace cartridges::bindings
