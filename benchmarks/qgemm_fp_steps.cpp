// How fast can a prompt-row tile of a GGUF format run on this core, given the fp32 steps its arithmetic puts after
// each sub-block's vpdpbusd? The qgemm tiles (qgemm_avx512.cpp) are bound by multiplies, not by loads or integer
// work: every fp32 multiply takes a slot a vpdpbusd could use (vnni_fp_pipes.cpp), and the contract of qgemm.h puts
// three after every sub-block of a Q4_K row (dw * dx, the FMA, the min's FMA), two after Q4_0's and Q6_K's. This
// times the tiles as built next to the same 6-row x 2-panel integer sums (`tile` below: tile2_t's pair_sums, in
// sub-block loops of one 256-value chunk) with other steps after each sub-block, from the integer sums alone to
// per-256 activation scales (llama.cpp's Q8_K for K-quant files), so a contract change is priced before it is built.
//
//     g++ -O3 -march=native -std=c++20 -Ipdserve/kernels/csrc -o /tmp/qgemm_fp_steps
//         benchmarks/qgemm_fp_steps.cpp pdserve/kernels/csrc/qgemm_pack.cpp && /tmp/qgemm_fp_steps [K] [rows]
//
// One thread; the decoded panels (K = 2,048: 80 KB for Q4_K) and activations stay in L1/L2, as on the many-rows
// path (qgemm_linear.cpp run_many). GMAC/s counts the products of the tile (rows x 32 columns x K); the last column
// is the fraction of vpdpbusd's peak on this core (12 independent chains, measured here first). Values are random
// and results unused beyond a checksum: only the instruction mix matters. Needs AVX-512 VNNI.
#include "qgemm_avx512.cpp"  // the tiles as built (tile2_t), in this translation unit
#include "vnni_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace pdserve::qgemm {
namespace {

constexpr int MR = 6;  // tile2_t's widest row tile (kMaxRows2)

// What a variant's steps read besides Dec and Act: per-256 activation scales, the sub-blocks' activation sums as
// s16 pairs (one 32-bit word per pair: vpbroadcastd feeds vpdpwssd), the mins m as s16 pairs per column, dmin.
struct Extra {
  std::vector<float> dx256;  // [rows][chunks]
  std::vector<int32_t> bsum2;  // [rows][nsub / 2]
  std::vector<int32_t> m2;     // [2 panels][nsub / 2][16]
  std::vector<float> dmin;     // [2 panels][chunks][16]
};

// tile2_t's 6 x 2 integer sums (pair_sums) with STEP's fp32 work after every sub-block and END's after every 256
// values.
// c0/c1: accumulators carried over K in registers (variants that keep per-chunk sums carry those instead and add
// them into acc, in L1, at the chunk's end).
template <int S, class Step, class End>
__attribute__((noinline)) void tile(const Dec& d0, const Dec& d1, int64_t nsubs, const Act& a, int64_t r0,
                                    float* acc0, float* acc1, Step step, End end) {
  constexpr int G = S / 4, PER = 256 / S;
  __m512 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = _mm512_setzero_ps(), c1[r] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < nsubs / PER; ++ch) {
    for (int64_t i = ch * PER; i < ch * PER + PER; ++i) {
      const uint8_t* w0 = d0.wq + i * G * kVec;
      const uint8_t* w1 = d1.wq + i * G * kVec;
      const int8_t* xi = a.q + a.qi(r0, i);
      const int32_t* init = a.init + a.si(r0, i);
      __m512i i0[MR], i1[MR];
      pair_sums<S, MR>(w0, w1, xi, init, i0, i1);
      step(i, c0, c1, i0, i1);
    }
    end(ch, c0, c1);
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc0 + r * kPanel, _mm512_add_ps(_mm512_loadu_ps(acc0 + r * kPanel), c0[r]));
    _mm512_storeu_ps(acc1 + r * kPanel, _mm512_add_ps(_mm512_loadu_ps(acc1 + r * kPanel), c1[r]));
  }
}

using Vf = __m512 (&)[MR];
using Vi = __m512i (&)[MR];

struct Bench {
  const QType& t;
  int64_t k, rows;
  std::vector<uint8_t> dbuf0, dbuf1, abuf;
  Dec d0, d1;
  Act a;
  Extra e;
  std::vector<float> acc0, acc1;

  Bench(int id, int64_t k_, int64_t rows_) : t(*find_type(id)), k(k_), rows(rows_) {
    const int64_t nch = k / t.qb, ns = k / t.s;
    dbuf0.resize(dec_bytes(t, nch) + 64), dbuf1.resize(dec_bytes(t, nch) + 64);
    d0 = dec_view(t, nch, dbuf0.data()), d1 = dec_view(t, nch, dbuf1.data());
    for (int64_t i = 0; i < k * kPanel; ++i) d0.wq[i] = rand() & 15, d1.wq[i] = rand() & 15;
    for (int64_t i = 0; i < ns * kPanel; ++i) {
      d0.dw[i] = d1.dw[i] = 0.01f * static_cast<float>(rand() % 100 + 1);
      d0.mw[i] = d1.mw[i] = -0.001f * static_cast<float>(rand() % 100);
    }
    abuf.resize(act_bytes(t, rows, k) + 64);
    a = act_view(t, rows, k, abuf.data());
    std::vector<float> x(static_cast<size_t>(rows * k));
    for (auto& v : x) v = static_cast<float>(rand() % 2001 - 1000) * 1e-3f;
    quantize_rows(t, x.data(), k, 0, rows, a);
    e.dx256.assign(static_cast<size_t>(rows * nch), 0.01f);
    e.bsum2.resize(static_cast<size_t>(rows * ns / 2));
    for (auto& v : e.bsum2) v = (rand() % 2000) | ((rand() % 2000) << 16);
    e.m2.resize(static_cast<size_t>(2 * ns / 2 * kPanel));
    for (auto& v : e.m2) v = (rand() % 64) | ((rand() % 64) << 16);
    e.dmin.assign(static_cast<size_t>(2 * nch * kPanel), -0.002f);
    acc0.assign(kPanel * MR, 0.0f), acc1.assign(kPanel * MR, 0.0f);
  }

  // Step: one FMA per sub-block into the registers' sums, c = fma(float(isum), dw, c).
  auto fma_dw() const {
    return [this](int64_t i, Vf c0, Vf c1, Vi i0, Vi i1) {
      const __m512 w0 = _mm512_loadu_ps(d0.dw + i * kPanel), w1 = _mm512_loadu_ps(d1.dw + i * kPanel);
      for (int r = 0; r < MR; ++r)
        c0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), w0, c0[r]),
        c1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), w1, c1[r]);
    };
  }
  // End of a chunk with per-256 activation scales: acc (in L1) += T * dx256, T (the registers' sums) back to zero.
  auto chunk_end(int64_t r0) {
    return [this, r0](int64_t ch, Vf c0, Vf c1) {
      float *a0 = acc0.data(), *a1 = acc1.data();
      for (int r = 0; r < MR; ++r) {
        const __m512 dx = _mm512_set1_ps(e.dx256[(r0 + r) * (k / 256) + ch]);
        _mm512_storeu_ps(a0 + r * kPanel, _mm512_fmadd_ps(c0[r], dx, _mm512_loadu_ps(a0 + r * kPanel)));
        _mm512_storeu_ps(a1 + r * kPanel, _mm512_fmadd_ps(c1[r], dx, _mm512_loadu_ps(a1 + r * kPanel)));
        c0[r] = _mm512_setzero_ps(), c1[r] = _mm512_setzero_ps();
      }
    };
  }

  // Best GMAC/s of `reps` passes of fn(r0) over every 6-row tile (within Act's 16-row tiles, as run_many keeps them).
  double rate(const std::function<void(int64_t)>& fn, int reps = 15) const {
    double best = 0;
    int64_t tiles = 0;
    for (int rep = 0; rep < reps; ++rep) {
      tiles = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t r0 = 0; r0 + MR <= rows; r0 += 16)
        for (int64_t o = 0; o + MR <= 16 && r0 + o + MR <= rows; o += MR, ++tiles) fn(r0 + o);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, static_cast<double>(tiles) * MR * 2 * kPanel * static_cast<double>(k) / s / 1e9);
    }
    return best;
  }
};

void report(const char* what, double gmacs, double peak) {
  std::printf("| %-66s | %5.0f | %.2f |\n", what, gmacs, gmacs / peak);
}

}  // namespace
}  // namespace pdserve::qgemm

int main(int argc, char** argv) {
  using namespace pdserve::qgemm;
  const int64_t k = argc > 1 ? std::atoll(argv[1]) : 2048, rows = argc > 2 ? std::atoll(argv[2]) : 96;
  if (k <= 0 || k % 256 != 0 || rows < MR) {
    std::fprintf(stderr, "K must be a positive multiple of 256 (whole K-quant chunks) and rows at least %d\n", MR);
    return 2;
  }
  const double peak = 64 * vpdpbusd_rate(20000000);
  std::printf("vpdpbusd alone: %.0f GMAC/s on one core; K = %lld, %lld rows\n\n", peak, static_cast<long long>(k),
              static_cast<long long>(rows));
  std::printf("| tile (6 rows x 2 panels), steps after each sub-block | GMAC/s | x peak |\n|---|---|---|\n");
  const auto none = [](int64_t, Vf, Vf) {};
  {  // S = 32: Q4_K (min) and Q4_0 (no min) layouts; the variants run on Q4_K's Dec and Act
    Bench b(12, k, rows);
    const int64_t ns = k / 32;
    const Dec &d0 = b.d0, &d1 = b.d1;
    const Act& a = b.a;
    float *acc0 = b.acc0.data(), *acc1 = b.acc1.data();
    report("as built, Q4_K (tile2_t): mul dw*dx, FMA, min FMA", b.rate([&](int64_t r0) {
      tile2_t<32, true, MR>(d0, d1, ns, a, 0, r0, acc0, acc1); }), peak);
    report("as built, Q4_0 layout (tile2_t<32, false>): mul dw*dx, FMA", b.rate([&](int64_t r0) {
      tile2_t<32, false, MR>(d0, d1, ns, a, 0, r0, acc0, acc1); }), peak);
    report("this file's loop with the Q4_K steps (tile2_t's in chunks of 8)", b.rate([&](int64_t r0) {
      tile<32>(d0, d1, ns, a, r0, acc0, acc1, [&](int64_t i, Vf c0, Vf c1, Vi i0, Vi i1) {
        const __m512 w0 = _mm512_loadu_ps(d0.dw + i * kPanel), w1 = _mm512_loadu_ps(d1.dw + i * kPanel);
        for (int r = 0; r < MR; ++r) {
          const __m512 dx = _mm512_set1_ps(a.dx[a.di(r0 + r, i)]);
          const float xs = a.xs[a.si(r0 + r, i)];
          c0[r] = fp_step<true>(c0[r], i0[r], w0, dx, d0.mw + i * kPanel, xs);
          c1[r] = fp_step<true>(c1[r], i1[r], w1, dx, d1.mw + i * kPanel, xs);
        }
      }, none); }), peak);
    report("integer sums only (convert, add): no fp32 multiply", b.rate([&](int64_t r0) {
      tile<32>(d0, d1, ns, a, r0, acc0, acc1, [](int64_t, Vf c0, Vf c1, Vi i0, Vi i1) {
        for (int r = 0; r < MR; ++r)
          c0[r] = _mm512_add_ps(c0[r], _mm512_cvtepi32_ps(i0[r])), c1[r] = _mm512_add_ps(c1[r], _mm512_cvtepi32_ps(i1[r]));
      }, none); }), peak);
    report("one FMA with dw (no activation scale, no min: not a product)", b.rate([&](int64_t r0) {
      tile<32>(d0, d1, ns, a, r0, acc0, acc1, b.fma_dw(), none); }), peak);
    report("per-256 activations, no min (Q4_0-like): FMA; FMA per 256", b.rate([&](int64_t r0) {
      tile<32>(d0, d1, ns, a, r0, acc0, acc1, b.fma_dw(), b.chunk_end(r0)); }), peak);
    report("per-256 activations, fp32 min: FMA, min FMA; FMA per 256", b.rate([&](int64_t r0) {
      tile<32>(d0, d1, ns, a, r0, acc0, acc1, [&](int64_t i, Vf c0, Vf c1, Vi i0, Vi i1) {
        const __m512 w0 = _mm512_loadu_ps(d0.dw + i * kPanel), w1 = _mm512_loadu_ps(d1.dw + i * kPanel);
        const __m512 m0 = _mm512_loadu_ps(d0.mw + i * kPanel), m1 = _mm512_loadu_ps(d1.mw + i * kPanel);
        for (int r = 0; r < MR; ++r) {
          const __m512 bs = _mm512_set1_ps(static_cast<float>(a.init[a.si(r0 + r, i)]));
          c0[r] = _mm512_fmadd_ps(m0, bs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), w0, c0[r]));
          c1[r] = _mm512_fmadd_ps(m1, bs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), w1, c1[r]));
        }
      }, b.chunk_end(r0)); }), peak);
    report("per-256 activations, integer min: FMA; vpdpwssd per 2; 2 FMA per 256", b.rate([&](int64_t r0) {
      tile<32>(d0, d1, ns, a, r0, acc0, acc1, b.fma_dw(), [&, r0](int64_t ch, Vf c0, Vf c1) {
        // the chunk's mins: sum m * bsum in int32 (4 vpdpwssd an output), one FMA with dmin
        const int64_t mp = ns / 2 * kPanel, dp = k / 256 * kPanel;  // the second panel's mins and dmin
        const int32_t* m = b.e.m2.data() + ch * 4 * kPanel;
        const __m512 dm0 = _mm512_loadu_ps(b.e.dmin.data() + ch * kPanel), dm1 = _mm512_loadu_ps(b.e.dmin.data() + dp + ch * kPanel);
        for (int r = 0; r < MR; ++r) {
          const int32_t* bs = b.e.bsum2.data() + ((r0 + r) * (k / 32) / 2) + ch * 4;
          __m512i mi0 = _mm512_setzero_si512(), mi1 = _mm512_setzero_si512();
          for (int p = 0; p < 4; ++p) {
            const __m512i x = _mm512_set1_epi32(bs[p]);
            mi0 = _mm512_dpwssd_epi32(mi0, _mm512_loadu_si512(m + p * kPanel), x);
            mi1 = _mm512_dpwssd_epi32(mi1, _mm512_loadu_si512(m + mp + p * kPanel), x);
          }
          c0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mi0), dm0, c0[r]);
          c1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mi1), dm1, c1[r]);
        }
        b.chunk_end(r0)(ch, c0, c1);
      }); }), peak);
  }
  {  // S = 16: Q6_K
    Bench b(14, k, rows);
    const int64_t ns = k / 16;
    const Dec &d0 = b.d0, &d1 = b.d1;
    float *acc0 = b.acc0.data(), *acc1 = b.acc1.data();
    report("as built, Q6_K (tile2_t<16, false>): mul dw*dx, FMA per 16 values", b.rate([&](int64_t r0) {
      tile2_t<16, false, MR>(d0, d1, ns, b.a, 0, r0, acc0, acc1); }), peak);
    report("Q6_K, per-256 activations: FMA per 16 values, FMA per 256", b.rate([&](int64_t r0) {
      tile<16>(d0, d1, ns, b.a, r0, acc0, acc1, b.fma_dw(), b.chunk_end(r0)); }), peak);
    std::printf("\n(checksum %g)\n", static_cast<double>(acc0[0] + acc1[5]));
  }
  return 0;
}
