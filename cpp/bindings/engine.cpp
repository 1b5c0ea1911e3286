// Python bindings: engine.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "cartridges/engine.h"
#include "common.h"

namespace cartridges::bindings {

void bind_engine(py::module_& m) {
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
}

}  // namespace cartridges::bindings
