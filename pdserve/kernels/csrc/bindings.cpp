// The Python module: ISA queries plus every registered kernel family.
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "registry.h"

namespace pdserve {

std::vector<Registrar>& registrars() {
  static std::vector<Registrar> all;
  return all;
}

namespace {
Isa isa_from_name(const std::string& name) {
  Isa isa;
  if (!parse_isa(name.c_str(), &isa)) {
    std::string all;
    for (int i = 0; i < kNumIsa; ++i) all += std::string(i ? ", " : "") + isa_name(static_cast<Isa>(i));
    throw std::invalid_argument("unknown ISA level '" + name + "' (" + all + ")");
  }
  return isa;
}
}  // namespace

}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pdserve;
  m.doc() = "pdserve native CPU kernels";
  m.def("cpu_isa", [] { return std::string(isa_name(cpu_best_isa())); }, "widest ISA level this CPU runs");
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); }, "ISA level the kernels use now");
  m.def("set_active_isa", [](const std::string& name) { set_active_isa(isa_from_name(name)); },
        "use a lower ISA level (tests run every level the CPU has)");
  m.def("cpu_supports", [](const std::string& name) { return cpu_supports(isa_from_name(name)); },
        "whether this CPU (and OS) runs every feature of the ISA level");
  m.def("stream_prefetch_bytes", [] { return g_stream_prefetch_bytes; },
        "how far ahead the decode GEMVs prefetch streamed weights into L2 (bytes; 0: off)");
  m.def("set_stream_prefetch_bytes", [](int64_t n) {
          TORCH_CHECK(n >= 0 && n <= (int64_t{1} << 20), "prefetch distance must be 0..1 MiB, got ", n);
          g_stream_prefetch_bytes = n;
        }, py::arg("n"), "change that distance (benchmarks; call while no kernel runs)");
  m.def("isa_levels", [] {
          std::vector<std::string> out;
          for (int i = 0; i < kNumIsa; ++i) out.emplace_back(isa_name(static_cast<Isa>(i)));
          return out;
        }, "every ISA level, lowest first");
  for (Registrar r : registrars()) r(m);
}
