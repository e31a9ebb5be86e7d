// The Python module: ISA queries plus every registered kernel family.
#include <stdexcept>
#include <string>

#include "common.h"
#include "registry.h"

namespace pdserve {

std::vector<Registrar>& registrars() {
  static std::vector<Registrar> all;
  return all;
}

namespace {
Isa parse_isa(const std::string& name) {
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "generic") return Isa::kGeneric;
  throw std::invalid_argument("unknown ISA level '" + name + "' (avx512, avx2, generic)");
}
}  // namespace

}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pdserve;
  m.doc() = "pdserve native CPU kernels";
  m.def("cpu_isa", [] { return std::string(isa_name(cpu_best_isa())); }, "widest ISA level this CPU runs");
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); }, "ISA level the kernels use now");
  m.def("set_active_isa", [](const std::string& name) { set_active_isa(parse_isa(name)); },
        "use a lower ISA level (tests run every level the CPU has)");
  for (Registrar r : registrars()) r(m);
}
