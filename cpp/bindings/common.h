#pragma once
// Helpers shared by the binding files: dtype names and prefix lists as Python sees them.
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cartridges/model.h"

namespace cartridges::bindings {

namespace py = pybind11;

at::ScalarType parse_dtype(const std::string& name);
std::string dtype_name(at::ScalarType t);

// Python hands prefixes as mutable shared pointers; the core reads them as const.
using PyPrefixList = std::vector<std::shared_ptr<KVPrefix>>;
inline PrefixList to_const(const PyPrefixList& list) { return PrefixList(list.begin(), list.end()); }
// A prefix's attention biases for Python: None when it has none.
inline std::optional<std::vector<at::Tensor>> biases_or_none(const std::vector<at::Tensor>& biases) {
  if (biases.empty()) return std::nullopt;
  return biases;
}

void bind_model(py::module_& m);
void bind_engine(py::module_& m);
void bind_training(py::module_& m);
void bind_store(py::module_& m);

}  // namespace cartridges::bindings
