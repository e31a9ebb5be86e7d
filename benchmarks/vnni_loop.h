// The loop the C++ benchmarks measure a core's vpdpbusd rate with (vnni_fp_pipes.cpp, qgemm_fp_steps.cpp): 12
// independent zmm chains an iteration, in inline assembly so the compiler can neither fold nor reorder them.
#pragma once

#include <chrono>

#define VNNI(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define VNNI12 VNNI(0) VNNI(1) VNNI(2) VNNI(3) VNNI(4) VNNI(5) VNNI(6) VNNI(7) VNNI(8) VNNI(9) VNNI(10) VNNI(11)

// Billions of iterations x 12 a second: n calls of body, 12 dot-product instructions each.
template <class Body>
double rate(long n, Body body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) body();
  return 12.0 * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

// zmm30/31 feed the chains; a build for an AVX-512 target must be told they change (without one, the compiler
// never allocates them and refuses the names).
#if defined(__AVX512F__)
#define VNNI_OPERANDS_CLOBBERED , "xmm30", "xmm31"
#else
#define VNNI_OPERANDS_CLOBBERED
#endif

// vpdpbusd alone, in G instructions a second (x 64 for GMAC/s).
inline double vpdpbusd_rate(long n) {
  asm volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "memory"
               VNNI_OPERANDS_CLOBBERED);
  return rate(n, [] {
    asm volatile(VNNI12 ::: "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                 "xmm10", "xmm11");
  });
}
