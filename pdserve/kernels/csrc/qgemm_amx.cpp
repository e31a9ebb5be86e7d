// AMX-INT8 qgemm tile: 16 activation rows x one 16-column panel per tdpbsud (A: s8 activations, 16 rows x S
// bytes; B: the decoded u8 weight vectors, which are already AMX's B layout: S/4 rows of 16 columns x 4 values).
// One tile product per sub-block gives the same exact int32 sums as vpdpbusd; the fp32 steps per sub-block are the
// VNNI path's (qgemm.h), so AMX and non-AMX rows are bitwise equal. Two C tiles alternate so the vector
// post-processing of one sub-block overlaps the tile product of the next. Everything else is the avx512 level's.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>
#include <initializer_list>

#include "qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile,amx-int8")

namespace pdserve::qgemm {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0/3: C (16 x 16 int32); 1/4: A (16 rows x S bytes); 2/5: B (S/4 rows x 64 bytes).
void configure(int s) {
  TileConfig cfg;
  for (int t : {0, 3}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  for (int t : {1, 4}) { cfg.rows[t] = 16; cfg.colsb[t] = static_cast<uint16_t>(s); }
  for (int t : {2, 5}) { cfg.rows[t] = static_cast<uint8_t>(s / 4); cfg.colsb[t] = 64; }
  // Not _tile_loadconfig: GCC 12's declares an 8-byte operand, so the compiler may drop the stores of the rest.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

struct Ctx {
  const Dec& d;
  const Act& a;
  int64_t s0, r0;
};

// The int32 sums of sub-block i (relative to s0) for the 16 rows, into buf: C tile C via A tile A and B tile B.
// GCC's tile intrinsics paste the tile number into the assembly, so it must be a literal: a macro per tile set.
#define PDSERVE_QGEMM_PRODUCT(NAME, C, A, B)                              \
  template <int S>                                                       \
  inline void NAME(const Ctx& x, int64_t i, int32_t* buf) {              \
    _tile_zero(C);                                                       \
    _tile_loadd(A, x.a.q + x.r0 * x.a.k + (x.s0 + i) * S, x.a.k);        \
    _tile_loadd(B, x.d.wq + i * S * kPanel, kVec);                       \
    _tile_dpbsud(C, A, B);                                               \
    _tile_stored(C, buf, kVec);                                          \
  }
PDSERVE_QGEMM_PRODUCT(product0, 0, 1, 2)
PDSERVE_QGEMM_PRODUCT(product1, 3, 4, 5)
#undef PDSERVE_QGEMM_PRODUCT

template <int S, bool MIN>
inline void post(const Ctx& x, int64_t i, const int32_t* buf, __m512 (&c)[16]) {
  const int64_t s = x.s0 + i;
  const __m512 dws = _mm512_loadu_ps(x.d.dw + i * kPanel);
  const __m512 mws = MIN ? _mm512_loadu_ps(x.d.mw + i * kPanel) : _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) {
    const int64_t row = x.r0 + r;
    const __m512i isum = _mm512_add_epi32(_mm512_load_si512(buf + r * 16), _mm512_set1_epi32(x.a.init[row * x.a.nsub + s]));
    const __m512 p = _mm512_mul_ps(dws, _mm512_set1_ps(x.a.dx[row * x.a.nb32 + s * S / QK]));
    c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), p, c[r]);
    if (MIN) c[r] = _mm512_fmadd_ps(mws, _mm512_set1_ps(x.a.xs[row * x.a.nsub + s]), c[r]);
  }
}

template <int S, bool MIN>
void tile16_t(const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  configure(S);
  const Ctx x{d, a, s0, r0};
  alignas(64) int32_t buf0[256], buf1[256];
  __m512 c[16];
  for (int r = 0; r < 16; ++r) c[r] = _mm512_loadu_ps(acc + r * kPanel);
  product0<S>(x, 0, buf0);
  for (int64_t i = 0; i < nsubs; i += 2) {
    if (i + 1 < nsubs) product1<S>(x, i + 1, buf1);
    post<S, MIN>(x, i, buf0, c);
    if (i + 1 < nsubs) {
      if (i + 2 < nsubs) product0<S>(x, i + 2, buf0);
      post<S, MIN>(x, i + 1, buf1, c);
    }
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(acc + r * kPanel, c[r]);
  _tile_release();
}

void tile16(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  if (t.s == 32) (t.min ? tile16_t<32, true> : tile16_t<32, false>)(d, nsubs, a, s0, r0, acc);
  else (t.min ? tile16_t<16, true> : tile16_t<16, false>)(d, nsubs, a, s0, r0, acc);
}

}  // namespace

const Ops kAmxOps = {avx512::quantize_act, avx512::decode, avx512::tile, 8, tile16};

}  // namespace pdserve::qgemm

#pragma GCC pop_options
#endif  // __x86_64__
