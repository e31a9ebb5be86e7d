// Runtime CPU feature detection and the process-wide active ISA level.
#include <atomic>
#include <stdexcept>
#include <string>

#include "common.h"

namespace pdserve {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

Isa cpu_best_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

namespace {
std::atomic<int>& active_level() {
  static std::atomic<int> level{static_cast<int>(cpu_best_isa())};
  return level;
}
}  // namespace

Isa active_isa() { return static_cast<Isa>(active_level().load(std::memory_order_relaxed)); }

void set_active_isa(Isa isa) {
  if (static_cast<int>(isa) > static_cast<int>(cpu_best_isa()))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) + " kernels");
  active_level().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace pdserve
