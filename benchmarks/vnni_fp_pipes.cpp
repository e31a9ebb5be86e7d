// Which instructions take a slot that a vpdpbusd (or vdpbf16ps) could use? The ceiling of the qgemm tiles, whose
// batch-invariant fp32 steps add a multiply and one or two FMAs per row to every 8 vpdpbusd (qgemm.h), and of the
// bf16 attention kernels, whose reductions and interleaves sit between their vdpbf16ps.
//
//     g++ -O2 -o /tmp/vnni_fp_pipes benchmarks/vnni_fp_pipes.cpp && /tmp/vnni_fp_pipes
//
// One core, registers (and one L1-resident buffer) only: 12 independent dot-product zmm chains per iteration, with
// other instructions (independent of the chains) spread between them or after them, in inline assembly so the
// compiler can neither fold nor reorder them. Prints dot products per second and the ratio to the loop alone: 1.00x
// means the added instructions ran on other pipes; 0.60x for 8 added means each took a dot product's slot. Needs
// AVX-512 VNNI; the vdpbf16ps table runs where the CPU has AVX512-BF16.
#include <cstdint>
#include <cstdio>

#include "vnni_loop.h"

#define BF16(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define CVT(i) "vcvtdq2ps %%zmm" #i ", %%zmm2" #i "\n\t"
#define BF1612 BF16(0) BF16(1) BF16(2) BF16(3) BF16(4) BF16(5) BF16(6) BF16(7) BF16(8) BF16(9) BF16(10) BF16(11)
#define X8(M) M(12) M(13) M(14) M(15) M(16) M(17) M(18) M(19)

// Eight of one instruction, each writing its own register (zmm12-19) from zmm28/29 or the buffer in %0.
#define OP_FMA(i) "vfmadd231ps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_MUL(i) "vmulps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_ADD(i) "vaddps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_MAX(i) "vmaxps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_CVT(i) "vcvtdq2ps %%zmm29, %%zmm" #i "\n\t"
#define OP_PADDD(i) "vpaddd %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_PSLLD(i) "vpslld $3, %%zmm29, %%zmm" #i "\n\t"
#define OP_PMULLD(i) "vpmulld %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_PMADDWD(i) "vpmaddwd %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_PMADDUBSW(i) "vpmaddubsw %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_DPWSSD(i) "vpdpwssd %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_UNPCKLPS(i) "vunpcklps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_PUNPCKLWD(i) "vpunpcklwd %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_SHUFPS(i) "vshufps $0x44, %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_SHUFF32X4(i) "vshuff32x4 $0x88, %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_PERMT2W(i) "vpermt2w %%zmm29, %%zmm28, %%zmm" #i "\n\t"
#define OP_LOAD(i) "vmovdqu64 (%0), %%zmm" #i "\n\t"
#define OP_BCASTD(i) "vpbroadcastd (%0), %%zmm" #i "\n\t"
#define OP_BCAST128(i) "vbroadcasti32x4 (%0), %%zmm" #i "\n\t"
#define OP_INSERT256(i) "vinserti64x4 $1, (%0), %%zmm28, %%zmm" #i "\n\t"

alignas(64) static uint8_t g_buf[64];

// 8 of each instruction after 12 dot products of the base (VNNI12 or BF1612), per iteration.
#define TABLE(BASE12, NAME)                                                                                          \
  do {                                                                                                               \
    const uint8_t* p = g_buf;                                                                                        \
    const double b = rate(n, [p] { asm volatile(BASE12 ::"r"(p) : "memory"); });                                     \
    std::printf("\n12 %s alone: %.3f G/s; with 8 of:\n", NAME, b);                                                   \
    const auto row = [&](const char* what, double r) { std::printf("  %-28s %.2fx\n", what, r / b); };             \
    row("vfmadd231ps", rate(n, [p] { asm volatile(BASE12 X8(OP_FMA) ::"r"(p) : "memory"); }));                      \
    row("vmulps", rate(n, [p] { asm volatile(BASE12 X8(OP_MUL) ::"r"(p) : "memory"); }));                           \
    row("vaddps", rate(n, [p] { asm volatile(BASE12 X8(OP_ADD) ::"r"(p) : "memory"); }));                           \
    row("vmaxps", rate(n, [p] { asm volatile(BASE12 X8(OP_MAX) ::"r"(p) : "memory"); }));                           \
    row("vcvtdq2ps", rate(n, [p] { asm volatile(BASE12 X8(OP_CVT) ::"r"(p) : "memory"); }));                        \
    row("vpaddd", rate(n, [p] { asm volatile(BASE12 X8(OP_PADDD) ::"r"(p) : "memory"); }));                         \
    row("vpslld", rate(n, [p] { asm volatile(BASE12 X8(OP_PSLLD) ::"r"(p) : "memory"); }));                         \
    row("vpmulld", rate(n, [p] { asm volatile(BASE12 X8(OP_PMULLD) ::"r"(p) : "memory"); }));                       \
    row("vpmaddwd", rate(n, [p] { asm volatile(BASE12 X8(OP_PMADDWD) ::"r"(p) : "memory"); }));                     \
    row("vpmaddubsw", rate(n, [p] { asm volatile(BASE12 X8(OP_PMADDUBSW) ::"r"(p) : "memory"); }));                 \
    row("vpdpwssd", rate(n, [p] { asm volatile(BASE12 X8(OP_DPWSSD) ::"r"(p) : "memory"); }));                      \
    row("vunpcklps", rate(n, [p] { asm volatile(BASE12 X8(OP_UNPCKLPS) ::"r"(p) : "memory"); }));                   \
    row("vpunpcklwd", rate(n, [p] { asm volatile(BASE12 X8(OP_PUNPCKLWD) ::"r"(p) : "memory"); }));                 \
    row("vshufps", rate(n, [p] { asm volatile(BASE12 X8(OP_SHUFPS) ::"r"(p) : "memory"); }));                       \
    row("vshuff32x4", rate(n, [p] { asm volatile(BASE12 X8(OP_SHUFF32X4) ::"r"(p) : "memory"); }));                 \
    row("vpermt2w", rate(n, [p] { asm volatile(BASE12 X8(OP_PERMT2W) ::"r"(p) : "memory"); }));                     \
    row("vmovdqu64 zmm, m512", rate(n, [p] { asm volatile(BASE12 X8(OP_LOAD) ::"r"(p) : "memory"); }));             \
    row("vpbroadcastd zmm, m32", rate(n, [p] { asm volatile(BASE12 X8(OP_BCASTD) ::"r"(p) : "memory"); }));         \
    row("vbroadcasti32x4 zmm, m128", rate(n, [p] { asm volatile(BASE12 X8(OP_BCAST128) ::"r"(p) : "memory"); }));   \
    row("vinserti64x4 zmm, m256", rate(n, [p] { asm volatile(BASE12 X8(OP_INSERT256) ::"r"(p) : "memory"); }));     \
  } while (0)

int main() {
  const long n = 20000000;
  asm volatile("vpxord %%zmm28, %%zmm28, %%zmm28\n\tvpxord %%zmm29, %%zmm29, %%zmm29\n\t"
               "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "memory");
  const double base = vpdpbusd_rate(10 * n);
  std::printf("12 vpdpbusd: %.3f G/s (%.0f GMAC/s)\n", base, 64 * base);
  const auto show = [&](const char* what, double r) { std::printf("%-40s %.3f G/s vpdpbusd (%.2fx)\n", what, r, r / base); };
  show("+ 2 FMA per 12", rate(10 * n, [] {
    asm volatile(VNNI(0) VNNI(1) VNNI(2) VNNI(3) FMA(12) VNNI(4) VNNI(5) VNNI(6) VNNI(7) FMA(13) VNNI(8) VNNI(9)
                 VNNI(10) VNNI(11) ::: "memory"); }));
  show("+ 3 FMA per 12", rate(10 * n, [] {
    asm volatile(VNNI(0) VNNI(1) VNNI(2) FMA(12) VNNI(3) VNNI(4) VNNI(5) FMA(13) VNNI(6) VNNI(7) VNNI(8) FMA(14)
                 VNNI(9) VNNI(10) VNNI(11) ::: "memory"); }));
  show("+ 6 FMA per 12", rate(10 * n, [] {
    asm volatile(VNNI(0) VNNI(1) FMA(12) VNNI(2) VNNI(3) FMA(13) VNNI(4) VNNI(5) FMA(14) VNNI(6) VNNI(7) FMA(15)
                 VNNI(8) VNNI(9) FMA(16) VNNI(10) VNNI(11) FMA(17) ::: "memory"); }));
  show("+ 3 convert per 12", rate(10 * n, [] {
    asm volatile(VNNI(0) VNNI(1) VNNI(2) CVT(0) VNNI(3) VNNI(4) VNNI(5) CVT(1) VNNI(6) VNNI(7) VNNI(8) CVT(2)
                 VNNI(9) VNNI(10) VNNI(11) ::: "memory"); }));
  show("+ 4.5 FMA per 12 (a Q4_1 tile: 3 per 8)", rate(5 * n, [] {
    asm volatile(VNNI12 VNNI12 FMA(12) FMA(13) FMA(14) FMA(15) FMA(16) FMA(17) FMA(18) FMA(19) FMA(12) ::: "memory");
  }) * 2);
  TABLE(VNNI12, "vpdpbusd");
  if (__builtin_cpu_supports("avx512bf16")) TABLE(BF1612, "vdpbf16ps");
  return 0;
}
