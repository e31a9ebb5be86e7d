// Runtime CPU feature detection and the process-wide active ISA level.
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common.h"

namespace pdserve {

namespace {
constexpr const char* kNames[kNumIsa] = {"generic", "avx2", "avx512", "avx512_bf16", "amx"};

#if defined(__x86_64__) || defined(__i386__)
// Linux gives a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
// without it the first tile instruction faults. Asked once; false where the kernel refuses.
bool os_grants_amx() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}
#endif
}  // namespace

const char* isa_name(Isa isa) {
  const int i = static_cast<int>(isa);
  return i >= 0 && i < kNumIsa ? kNames[i] : "unknown";
}

bool parse_isa(const char* name, Isa* out) {
  for (int i = 0; i < kNumIsa; ++i) {
    if (std::strcmp(name, kNames[i]) == 0) {
      *out = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

bool cpu_supports(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kAmx:
      if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
            __builtin_cpu_supports("amx-bf16") && os_grants_amx()))
        return false;
      [[fallthrough]];
    case Isa::kAvx512Bf16:
      if (!__builtin_cpu_supports("avx512bf16")) return false;
      [[fallthrough]];
    case Isa::kAvx512:
      if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vnni")))
        return false;
      [[fallthrough]];
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kGeneric:
      return true;
  }
  return false;
#else
  return isa == Isa::kGeneric;
#endif
}

Isa cpu_best_isa() {
  static const Isa best = [] {
    for (int i = kNumIsa - 1; i > 0; --i)
      if (cpu_supports(static_cast<Isa>(i))) return static_cast<Isa>(i);
    return Isa::kGeneric;
  }();
  return best;
}

namespace {
std::atomic<int>& active_level() {
  static std::atomic<int> level{static_cast<int>(cpu_best_isa())};
  return level;
}
}  // namespace

Isa active_isa() { return static_cast<Isa>(active_level().load(std::memory_order_relaxed)); }

void set_active_isa(Isa isa) {
  if (!cpu_supports(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) + " kernels");
  active_level().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace pdserve
