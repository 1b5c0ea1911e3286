#pragma once
// Helpers shared by the binding files: dtype names and prefix lists as Python sees them.
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <memory>
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

void bind_model(py::module_& m);
void bind_engine(py::module_& m);
void bind_training(py::module_& m);
void bind_store(py::module_& m);

}  // namespace cartridges::bindings
