// AMX-INT8 qgemm tile: 16 activation rows x one 16-column panel per tdpbssd (A: s8 activations, 16 rows x S
// bytes; B: the decoded weight vectors, which are already AMX's B layout, S/4 rows of 16 columns x 4 values, here
// shifted to the signed values u - off by decode16, so no zero-point term is left). One tile product per sub-block
// gives the same exact int32 sums as vpdpbusd; the fp32 steps per sub-block are the VNNI path's (qgemm.h), so AMX
// and non-AMX rows are bitwise equal. Two C tiles alternate so the vector post-processing of one sub-block overlaps
// the tile product of the next. Everything else is the avx512 level's, except decode_bf16: a panel as bf16 for the
// prompt rows' path (QgemmWeight::forward_rows), which multiplies on fgemm's bf16 AMX tiles.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>
#include <initializer_list>

#include "qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c,amx-tile,amx-int8")

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

// Sub-block i (relative to s0) of the 16 rows into C tile C (via A tile A and B tile B).
// GCC's tile intrinsics paste the tile number into the assembly, so it must be a literal: a macro per tile set.
#define PDSERVE_QGEMM_PRODUCT(NAME, C, A, B)                              \
  template <int S>                                                       \
  inline void NAME(const Ctx& x, int64_t i) {                            \
    _tile_zero(C);                                                       \
    _tile_loadd(A, x.a.q + x.a.qi(x.r0, x.s0 + i), S);                   \
    _tile_loadd(B, x.d.wq + i * S * kPanel, kVec);                       \
    _tile_dpbssd(C, A, B);                                               \
  }
PDSERVE_QGEMM_PRODUCT(product0, 0, 1, 2)
PDSERVE_QGEMM_PRODUCT(product1, 3, 4, 5)
#undef PDSERVE_QGEMM_PRODUCT

template <int S, bool MIN>
inline void post(const Ctx& x, int64_t i, const int32_t* buf, __m512 (&c)[16]) {
  const int64_t s = x.s0 + i;
  const __m512 dws = _mm512_loadu_ps(x.d.dw + i * kPanel);
  const float* dx = x.a.dx + x.a.di(x.r0, s * S / QK);  // the 16 rows' scales, consecutive
  const float* xs = x.a.xs + x.a.si(x.r0, s);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512 p = _mm512_mul_ps(dws, _mm512_set1_ps(dx[r]));
    c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf + r * 16)), p, c[r]);
    if (MIN) c[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x.d.mw + i * kPanel), _mm512_set1_ps(xs[r]), c[r]);
  }
}

template <int S, bool MIN>
void tile16_t(const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  const Ctx x{d, a, s0, r0};
  alignas(64) int32_t buf[4][256];
  __m512 c[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) c[r] = _mm512_loadu_ps(acc + r * kPanel);
  // Sub-block i: its product is issued two half-steps ahead, its C tile stored to buf[i % 4], post-processed a
  // half-step later (reading a tile store back at once stalls) and before the next products are issued: tile
  // instructions enter the core in order, so vector work placed before them is what overlaps the tile unit's.
  product0<S>(x, 0);
  if (nsubs > 1) product1<S>(x, 1);
  int64_t i = 0;
  for (; i < nsubs; i += 2) {
    if (i >= 2) post<S, MIN>(x, i - 2, buf[(i - 2) & 3], c);
    _tile_stored(0, buf[i & 3], kVec);
    if (i + 2 < nsubs) product0<S>(x, i + 2);
    if (i >= 1) post<S, MIN>(x, i - 1, buf[(i - 1) & 3], c);
    if (i + 1 < nsubs) {
      _tile_stored(3, buf[(i + 1) & 3], kVec);
      if (i + 3 < nsubs) product1<S>(x, i + 3);
    }
  }
  for (int64_t j = i - 2; j < nsubs; ++j) post<S, MIN>(x, j, buf[j & 3], c);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(acc + r * kPanel, c[r]);
}

void tile16(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  if (t.s == 32) (t.min ? tile16_t<32, true> : tile16_t<32, false>)(d, nsubs, a, s0, r0, acc);
  else (t.min ? tile16_t<16, true> : tile16_t<16, false>)(d, nsubs, a, s0, r0, acc);
}

// The avx512 decoder's values shifted to u - off (signed bytes: every type's fit) for tdpbssd; configures the
// calling thread's tiles for tile16 (end16 releases them).
void decode16(const QType& t, const uint8_t* packed, int64_t n, const Dec& d) {
  configure(t.s);
  avx512::decode(t, packed, n, d);
  if (t.off == 0) return;
  const __m512i off = _mm512_set1_epi8(static_cast<char>(t.off));
  for (int64_t i = 0; i < n * t.qb * kPanel; i += kVec)
    _mm512_storeu_si512(d.wq + i, _mm512_sub_epi8(_mm512_loadu_si512(d.wq + i), off));
}

void end16() { _tile_release(); }

// Weight vector z holds K values 4z .. 4z + 3 of the 16 columns (byte 4c + j: column c, K value 4z + j); they
// become bf16 pairs 2z (K 4z, 4z + 1) and 2z + 1 (K 4z + 2, 4z + 3): dword c = (low: even K, high: odd K).
// The products and sums round as dequant_decoded's (explicit rounding: never contracted into an FMA).
void decode_bf16(const QType& t, const uint8_t* packed, int64_t n, const Dec& d, uint16_t* out) {
  avx512::decode(t, packed, n, d);
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i off = _mm512_set1_epi32(t.off), byte = _mm512_set1_epi32(0xFF);
  const int64_t nvec = n * t.z();
  // word 2c <- word c, word 2c + 1 <- word 16 + c: the two halves interleaved into (even K, odd K) dwords
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t z = 0; z < nvec; ++z) {
    const __m512i v = _mm512_loadu_si512(d.wq + z * kVec);
    const int64_t sub = 4 * z / t.s;
    const __m512 dw = _mm512_loadu_ps(d.dw + sub * kPanel);
    const __m512 mw = t.min ? _mm512_loadu_ps(d.mw + sub * kPanel) : _mm512_setzero_ps();
    __m512 w[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * j), byte), off);
      w[j] = _mm512_mul_round_ps(dw, _mm512_cvtepi32_ps(q), kRn);
      if (t.min) w[j] = _mm512_add_round_ps(w[j], mw, kRn);
    }
    // vcvtne2ps2bf16 rounds to nearest even and reads subnormals as zero: bf16 lanes 0..15 = w[0], 16..31 = w[1]
    _mm512_storeu_si512(out + 2 * z * 32, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0])));
    _mm512_storeu_si512(out + (2 * z + 1) * 32,
                        _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2])));
  }
}

// Ops::few_rows on this level: 9-16 rows of every type (AMX tiles take over from 32 rows). Sapphire Rapids, weights
// from memory: at 12-16 rows the row tiles gain (Q4_1 135M 0.80-0.85x, Q4_K 1.7B 0.90-1.0x); at 24-31 rows Q4_K's
// 1.7B linears ran 1.0-1.1x the VNNI tiles' time over the decoded block, so those rows keep the tiles.
int64_t few_rows(const QType&) { return 16; }

}  // namespace

const Ops kAmxOps = {avx512::quantize_act, avx512::decode, avx512::tile, 8, avx512::gemv, few_rows, decode16, tile16,
                      end16, decode_bf16};

}  // namespace pdserve::qgemm

#pragma GCC pop_options
#endif  // __x86_64__
