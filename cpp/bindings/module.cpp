// The pybind11 module `cartridges_core`: one file per area (model, engine, training, store),
// each only declaring Python names for C++ types and calls. No logic lives in the bindings.
#include "common.h"

namespace cartridges::bindings {

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

}  // namespace cartridges::bindings

PYBIND11_MODULE(cartridges_core, m) {
  using namespace cartridges::bindings;
  m.doc() = "C++ core of cartridges: Llama-family forward with KV cache and prefixes, the serving engine, "
            "cartridge training, the store.";
  bind_model(m);
  bind_engine(m);
  bind_training(m);
  bind_store(m);
}
