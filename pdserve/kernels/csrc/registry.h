// Each kernel file registers its Python bindings with PDSERVE_REGISTER(fn); bindings.cpp calls them all, so adding a
// kernel file touches no shared list.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace pdserve {

using Registrar = void (*)(pybind11::module_&);
std::vector<Registrar>& registrars();
struct RegisterOps {
  explicit RegisterOps(Registrar r) { registrars().push_back(r); }
};

}  // namespace pdserve

#define PDSERVE_REGISTER(fn) static ::pdserve::RegisterOps pdserve_register_##fn(fn)
