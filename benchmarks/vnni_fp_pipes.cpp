// Does an fp32 FMA (or int->fp32 convert) take a slot that a vpdpbusd could use? The ceiling of the qgemm tiles,
// whose batch-invariant fp32 steps add a multiply and one or two FMAs per row to every 8 vpdpbusd (qgemm.h).
//
//     g++ -O2 -o /tmp/vnni_fp_pipes benchmarks/vnni_fp_pipes.cpp && /tmp/vnni_fp_pipes
//
// One core, registers only: 12 independent vpdpbusd zmm chains per iteration, with k fp32 FMAs (independent
// chains) or converts spread between them, in inline assembly so the compiler can neither fold nor reorder them.
// Prints vpdpbusd per second and the ratio to the loop without fp32 work. Needs AVX-512 VNNI.
#include <chrono>
#include <cstdio>

#define VNNI(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define CVT(i) "vcvtdq2ps %%zmm" #i ", %%zmm2" #i "\n\t"
#define VNNI12 VNNI(0) VNNI(1) VNNI(2) VNNI(3) VNNI(4) VNNI(5) VNNI(6) VNNI(7) VNNI(8) VNNI(9) VNNI(10) VNNI(11)

template <class Body>
double rate(long n, Body body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) body();
  return 12.0 * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

int main() {
  const long n = 200000000;
  asm volatile("vpxord %%zmm28, %%zmm28, %%zmm28\n\tvpxord %%zmm29, %%zmm29, %%zmm29\n\t"
               "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "memory");
  const double base = rate(n, [] { asm volatile(VNNI12 ::: "memory"); });
  std::printf("12 vpdpbusd: %.3f G/s (%.0f GMAC/s)\n", base, 64 * base);
  const auto show = [&](const char* what, double r) { std::printf("%-40s %.3f G/s vpdpbusd (%.2fx)\n", what, r, r / base); };
  show("+ 2 FMA per 12", rate(n, [] {
    asm volatile(VNNI(0) VNNI(1) VNNI(2) VNNI(3) FMA(12) VNNI(4) VNNI(5) VNNI(6) VNNI(7) FMA(13) VNNI(8) VNNI(9)
                 VNNI(10) VNNI(11) ::: "memory"); }));
  show("+ 3 FMA per 12", rate(n, [] {
    asm volatile(VNNI(0) VNNI(1) VNNI(2) FMA(12) VNNI(3) VNNI(4) VNNI(5) FMA(13) VNNI(6) VNNI(7) VNNI(8) FMA(14)
                 VNNI(9) VNNI(10) VNNI(11) ::: "memory"); }));
  show("+ 6 FMA per 12", rate(n, [] {
    asm volatile(VNNI(0) VNNI(1) FMA(12) VNNI(2) VNNI(3) FMA(13) VNNI(4) VNNI(5) FMA(14) VNNI(6) VNNI(7) FMA(15)
                 VNNI(8) VNNI(9) FMA(16) VNNI(10) VNNI(11) FMA(17) ::: "memory"); }));
  show("+ 3 convert per 12", rate(n, [] {
    asm volatile(VNNI(0) VNNI(1) VNNI(2) CVT(0) VNNI(3) VNNI(4) VNNI(5) CVT(1) VNNI(6) VNNI(7) VNNI(8) CVT(2)
                 VNNI(9) VNNI(10) VNNI(11) ::: "memory"); }));
  show("+ 4.5 FMA per 12 (a Q4_1 tile: 3 per 8)", rate(n / 2, [] {
    asm volatile(VNNI12 VNNI12 FMA(12) FMA(13) FMA(14) FMA(15) FMA(16) FMA(17) FMA(18) FMA(19) FMA(12) ::: "memory");
  }) * 2);
  return 0;
}
