// The one ISA dispatch mechanism of the native kernels. A kernel family lists what it implements per level:
//
//   const IsaTable<GemmFn> kGemm = {{Isa::kGeneric, gemm_generic}, PDSERVE_X86({Isa::kAvx512, gemm_avx512})};
//   kGemm.pick()(...);
//
// pick() returns the entry of the highest level at or below active_isa() that the family has; a level without
// its own entry runs the one below it (an amx CPU runs the avx512 kernels of a family that has no amx entry).
// Every family has a generic entry, so pick() never fails.
#pragma once

#include <initializer_list>
#include <stdexcept>
#include <utility>

#include "common.h"

#if defined(__x86_64__)
#define PDSERVE_X86(...) __VA_ARGS__
#else
#define PDSERVE_X86(...)
#endif

namespace pdserve {

template <class T>
class IsaTable {
 public:
  IsaTable(std::initializer_list<std::pair<Isa, T>> entries) {
    for (const auto& [isa, fn] : entries) entries_[static_cast<int>(isa)] = fn;
    if (!entries_[0]) throw std::logic_error("an IsaTable needs a generic entry");
  }
  // The entry for `isa` (default: the active level).
  T pick(Isa isa) const {
    for (int i = static_cast<int>(isa); i > 0; --i)
      if (entries_[i]) return entries_[i];
    return entries_[0];
  }
  T pick() const { return pick(active_isa()); }
  // The level whose entry pick() returns (for descriptions and tests).
  Isa level(Isa isa) const {
    for (int i = static_cast<int>(isa); i > 0; --i)
      if (entries_[i]) return static_cast<Isa>(i);
    return Isa::kGeneric;
  }
  Isa level() const { return level(active_isa()); }

 private:
  T entries_[kNumIsa] = {};
};

}  // namespace pdserve
