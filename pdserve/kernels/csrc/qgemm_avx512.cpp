// AVX-512 (F/BW/VL/DQ + VNNI) qgemm kernels: lane c of every zmm is output column c of the panel, so vpdpbusd
// (u8 weights x s8 activations broadcast 4 at a time) accumulates each column's exact int32 sub-block sum and the
// fp32 steps per sub-block are the ones of qgemm_generic.cpp, in the same order.
#if defined(__x86_64__)
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

#include "qgemm_decode.h"

namespace pdserve::qgemm {
namespace {

constexpr int kMaxRows = 8;

struct P512 {
  using V = __m512i;
  using F = __m512;
  static V load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store(uint8_t* p, V v) { _mm512_storeu_si512(p, v); }
  static V zero() { return _mm512_setzero_si512(); }
  static V and8(V v, uint8_t m) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(m))); }
  static V or_(V a, V b) { return _mm512_or_si512(a, b); }
  static V srl(V v, int n) { return _mm512_srl_epi16(v, _mm_cvtsi32_si128(n)); }
  static V sll(V v, int n) { return _mm512_sll_epi16(v, _mm_cvtsi32_si128(n)); }
  static V lut(V v) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Table));
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(t), v);
  }
  static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m512i bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F u8(const uint8_t* p) { return _mm512_cvtepi32_ps(bytes(p)); }
  static F s8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F lo4(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_and_si512(bytes(p), _mm512_set1_epi32(15))); }
  static F hi4(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes(p), 4)); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F neg(F a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
  static void store(float* p, F f) { _mm512_storeu_ps(p, f); }
};

// 32 floats -> int8 (round half to even) with d = amax/127, as qgemm_generic.cpp's quantize_act.
void quantize_rows(const QType& t, const float* x, int64_t ldx, int64_t r0, int64_t r1, const Act& a) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * ldx;
    for (int64_t b = 0; b < a.nb32; ++b) {
      const __m512 v0 = _mm512_loadu_ps(xr + b * QK), v1 = _mm512_loadu_ps(xr + b * QK + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.0f;
      const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      alignas(32) int8_t q[QK];
      _mm_store_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
      _mm_store_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
      int32_t sums[2];
      if (t.s == 16) {
        sums[0] = _mm512_reduce_add_epi32(i0);
        sums[1] = _mm512_reduce_add_epi32(i1);
      } else {
        sums[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
      }
      put_block(t, a, r, b, q, d, sums);
    }
  }
}

// The contract's fp32 steps of one sub-block for one row (qgemm.h): acc = fma(float(isum), dw * dx, acc), then for
// types with a min acc = fma(mw, xs, acc) (mw: the sub-block's 16 mins). Every tile and GEMV here takes them from here.
template <bool MIN>
__attribute__((always_inline)) inline __m512 fp_step(__m512 acc, __m512i isum, __m512 dw, __m512 dx, const float* mw,
                                                     float xs) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx), acc);
  if constexpr (MIN) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mw), _mm512_set1_ps(xs), acc);
  return acc;
}

// One sub-block (global index s) for MR activation rows x the panel's 16 columns: each weight vector (wv(g), in a
// register) feeds every row (MR independent vpdpbusd chains; short tiles split each row's sum over more chains:
// integer adds, the same result), then each row takes the contract's fp32 steps with the sub-block's dw/mw.
template <int S, bool MIN, int MR, class WV>
inline void sub_step(WV wv, const float* dw, const float* mw, const Act& a, int64_t s, int64_t r0, __m512 (&c)[MR]) {
  constexpr int G = S / 4, CH = MR <= 2 ? 4 : MR <= 4 ? 3 : 2;  // >= 10 chains of 5-cycle vpdpbusd
  // rows r0..r0+MR share one of Act's tiles: row r at constant offsets from these
  const int8_t* xi = a.q + a.qi(r0, s);
  const int32_t* init = a.init + a.si(r0, s);
  const float* xs = a.xs + a.si(r0, s);
  const float* dx = a.dx + a.di(r0, s * S / QK);
  __m512i isum[MR][CH];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    isum[r][0] = _mm512_set1_epi32(init[r]);
    for (int h = 1; h < CH; ++h) isum[r][h] = _mm512_setzero_si512();
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const __m512i w = wv(g);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t xv;
      std::memcpy(&xv, xi + r * S + 4 * g, 4);
      isum[r][g % CH] = _mm512_dpbusd_epi32(isum[r][g % CH], w, _mm512_set1_epi32(xv));
    }
  }
  const __m512 dws = _mm512_loadu_ps(dw);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    __m512i sum = isum[r][0];
    for (int h = 1; h < CH; ++h) sum = _mm512_add_epi32(sum, isum[r][h]);
    c[r] = fp_step<MIN>(c[r], sum, dws, _mm512_set1_ps(dx[r]), mw, MIN ? xs[r] : 0.0f);
  }
}

// MR activation rows x the panel's 16 columns over nsubs decoded sub-blocks (the first is global sub-block s0).
template <int S, bool MIN, int MR>
void tile_t(const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  __m512 c[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) c[r] = _mm512_loadu_ps(acc + r * kPanel);
  for (int64_t i = 0; i < nsubs; ++i) {
    const uint8_t* wp = d.wq + i * (S / 4) * kVec;
    sub_step<S, MIN, MR>([wp](int g) { return _mm512_loadu_si512(wp + g * kVec); }, d.dw + i * kPanel,
                         d.mw + i * kPanel, a, s0 + i, r0, c);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kPanel, c[r]);
}

// One sub-block's exact int32 sums for MR activation rows x two panels: w0/w1 the panels' S / 4 weight vectors,
// row r's S activations at xi + r * S, its starting value init[r]; each activation broadcast feeds both panels.
template <int S, int MR>
__attribute__((always_inline)) inline void pair_sums(const uint8_t* w0, const uint8_t* w1, const int8_t* xi,
                                                     const int32_t* init, __m512i (&i0)[MR], __m512i (&i1)[MR]) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) i0[r] = i1[r] = _mm512_set1_epi32(init[r]);
#pragma GCC unroll 8
  for (int g = 0; g < S / 4; ++g) {
    const __m512i wa = _mm512_loadu_si512(w0 + g * kVec), wb = _mm512_loadu_si512(w1 + g * kVec);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t xv;
      std::memcpy(&xv, xi + r * S + 4 * g, 4);
      const __m512i x = _mm512_set1_epi32(xv);
      i0[r] = _mm512_dpbusd_epi32(i0[r], wa, x);
      i1[r] = _mm512_dpbusd_epi32(i1[r], wb, x);
    }
  }
}

// Two panels' 16 columns each for MR rows: each activation broadcast feeds a vpdpbusd of both panels, so a sub-block
// takes MR x G broadcasts for 2 x MR x G products (one panel's tile: as many broadcasts for half the products; it
// pays on cores that issue two vpdpbusd a cycle, BENCHMARKS.md). MR x 2 chains per row block; a row's int32 sums
// are exact whatever the chains and its fp32 steps are sub_step's, in the same order: tile_t's bits.
template <int S, bool MIN, int MR>
void tile2_t(const Dec& d0, const Dec& d1, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc0,
             float* acc1) {
  constexpr int G = S / 4;
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) c0[r] = _mm512_loadu_ps(acc0 + r * kPanel), c1[r] = _mm512_loadu_ps(acc1 + r * kPanel);
  for (int64_t i = 0; i < nsubs; ++i) {
    const int64_t s = s0 + i;
    const uint8_t* w0 = d0.wq + i * G * kVec;
    const uint8_t* w1 = d1.wq + i * G * kVec;
    const int8_t* xi = a.q + a.qi(r0, s);
    const int32_t* init = a.init + a.si(r0, s);
    const float* xs = a.xs + a.si(r0, s);
    const float* dx = a.dx + a.di(r0, s * S / QK);
    __m512i i0[MR], i1[MR];
    pair_sums<S, MR>(w0, w1, xi, init, i0, i1);
    const __m512 dw0 = _mm512_loadu_ps(d0.dw + i * kPanel), dw1 = _mm512_loadu_ps(d1.dw + i * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 dxr = _mm512_set1_ps(dx[r]);
      const float xsr = MIN ? xs[r] : 0.0f;
      c0[r] = fp_step<MIN>(c0[r], i0[r], dw0, dxr, d0.mw + i * kPanel, xsr);
      c1[r] = fp_step<MIN>(c1[r], i1[r], dw1, dxr, d1.mw + i * kPanel, xsr);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc0 + r * kPanel, c0[r]), _mm512_storeu_ps(acc1 + r * kPanel, c1[r]);
}

constexpr int kMaxRows2 = 6;  // 2 x 6 int32 chains, 2 x 6 fp32 accumulators, two weight vectors and a broadcast

using Tile2Fn = void (*)(const Dec&, const Dec&, int64_t, const Act&, int64_t, int64_t, float*, float*);

template <int S, bool MIN, int... R>
constexpr std::array<Tile2Fn, sizeof...(R)> tiles2(std::integer_sequence<int, R...>) {
  return {tile2_t<S, MIN, R + 1>...};
}

void tile2_rows(const QType& t, const Dec& d0, const Dec& d1, int64_t nsubs, const Act& a, int64_t s0, int64_t r0,
                int64_t mr, float* acc0, float* acc1) {
  static constexpr auto k32 = tiles2<32, false>(std::make_integer_sequence<int, kMaxRows2>());
  static constexpr auto k32m = tiles2<32, true>(std::make_integer_sequence<int, kMaxRows2>());
  static constexpr auto k16 = tiles2<16, false>(std::make_integer_sequence<int, kMaxRows2>());
  static constexpr auto k16m = tiles2<16, true>(std::make_integer_sequence<int, kMaxRows2>());
  const auto& table = t.s == 32 ? (t.min ? k32m : k32) : (t.min ? k16m : k16);
  table[mr - 1](d0, d1, nsubs, a, s0, r0, acc0, acc1);
}

using TileFn = void (*)(const Dec&, int64_t, const Act&, int64_t, int64_t, float*);

template <int S, bool MIN, int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {tile_t<S, MIN, R + 1>...};
}

void tile_rows(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr, float* acc) {
  static constexpr auto k32 = tiles<32, false>(std::make_integer_sequence<int, kMaxRows>());
  static constexpr auto k32m = tiles<32, true>(std::make_integer_sequence<int, kMaxRows>());
  static constexpr auto k16 = tiles<16, false>(std::make_integer_sequence<int, kMaxRows>());
  static constexpr auto k16m = tiles<16, true>(std::make_integer_sequence<int, kMaxRows>());
  const auto& table = t.s == 32 ? (t.min ? k32m : k32) : (t.min ? k16m : k16);
  table[mr - 1](d, nsubs, a, s0, r0, acc);
}

// Few rows straight from the packed panel: each weight vector decoded into a register and used at once (hot Q4_K
// GEMV on Zen 4: 34 GB/s against 24 decoding to an L1 buffer first). Every chunk loop of these GEMVs prefetches
// the panel's bytes a fixed distance ahead into L2 (prefetch_ahead): with the arithmetic between its loads a core
// keeps too few misses in flight to stream from DRAM on its own (prefetching into L1 instead was slower).
template <Fmt f, int MR>
void gemv_t(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, float* acc) {
  constexpr int ns = f.qb / f.s, G = f.s / 4;
  const int64_t cb = t.chunk_bytes();
  alignas(64) float dw[16 * kPanel], mw[16 * kPanel];
  __m512 c[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) c[r] = _mm512_loadu_ps(acc + r * kPanel);
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const uint8_t* p = packed + ch * cb;
    if constexpr (!f.raw) prefetch_ahead(p, cb);  // Q8_0's bare loads stream on their own: 0.85x with it
    decode_scales<P512>(t, p, dw, mw);
    const uint8_t* v = p + t.scale_bytes();
    for (int j = 0; j < ns; ++j)
      sub_step<f.s, f.min, MR>([v, j](int g) { return weight_vector<P512, f>(v, j * G + g); }, dw + j * kPanel,
                               mw + j * kPanel, a, ch * ns + j, r0, c);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kPanel, c[r]);
}

// One activation row (a decode) over 256-value chunks of plain nibbles (Q4_K, IQ4_XS): each 64-byte nibble unit is
// loaded once for the two weight vectors it holds (low nibbles: sub-block b, high: H + b), with one int32 sum per
// sub-block and no split chains; sub-block b's fp32 steps follow at once, the high half's after the low half (K
// order, the contract's steps as sub_step's). Per row, ~1.2x gemv_t's rate on Zen 4 (one core, cold weights). The
// chunk's L2 prefetch goes out in H pieces, one per pass of the b loop: all at the chunk's start, the burst held up
// the loads behind it (Zen 4, from DRAM: 1.25-1.4x this way).
template <Fmt f, int LT>
void gemv1_t(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, float* acc) {
  constexpr int ns = f.qb / f.s, G = f.s / 4, Z = f.qb / 4, Z2 = Z / 2, H = ns / 2;
  constexpr int offp2 = Z2 * kVec, offp1 = offp2 + (f.p2 >= 0 ? Z / 4 * kVec : 0);
  // The row's activation data at compile-time strides (Act's tiles of T = 2^LT rows): sub-blocks T x S bytes apart
  // in q, T apart in init/xs, 32-blocks T apart in dx; so every address of a chunk is a base plus an immediate.
  constexpr int64_t XI = int64_t{1} << LT, XQ = XI * f.s, XD = XI * (f.qb / QK);
  const int64_t cb = t.chunk_bytes();
  const int8_t* xq = a.q + a.qi(r0, 0);
  const int32_t* xinit = a.init + a.si(r0, 0);
  const float* xsum = f.min ? a.xs + a.si(r0, 0) : nullptr;
  const float* xdx = a.dx + a.di(r0, 0);
  alignas(64) float dw[16 * kPanel], mw[16 * kPanel];
  __m512 c = _mm512_loadu_ps(acc);
  auto step = [&](int j, __m512i isum) {  // sub-block j of the chunk: the fp32 steps
    const float dx = xdx[j * f.s / QK * XI];
    c = fp_step<f.min>(c, isum, _mm512_load_ps(dw + j * kPanel), _mm512_set1_ps(dx), mw + j * kPanel,
                       f.min ? xsum[j * XI] : 0.0f);
  };
  const int64_t part = (cb / H + 63) / 64 * 64;  // the chunk's prefetch in H pieces, one per sub-block pair
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const uint8_t* p = packed + ch * cb;
    decode_scales<P512>(t, p, dw, mw);
    const uint8_t* v = p + t.scale_bytes();
    __m512i hi_sum[H];  // the second half's sub-blocks wait for the first half's fp32 steps (K order)
#pragma GCC unroll 8
    for (int b = 0; b < H; ++b) {  // sub-block b from low nibbles, H + b from the high nibbles of the same units
      prefetch_ahead(p + b * part, std::min<int64_t>(part, cb - b * part));
      __m512i lo_sum = _mm512_set1_epi32(xinit[b * XI]);
      hi_sum[b] = _mm512_set1_epi32(xinit[(H + b) * XI]);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const int u = b * G + g;
        const __m512i raw = P512::load(v + u * kVec);
        __m512i lo = P512::and8(raw, 0x0F), hi = P512::and8(P512::srl(raw, 4), 0x0F);
        if constexpr (f.p2 >= 0) {
          lo = P512::or_(lo, place<P512>(P512::load(v + offp2 + (u / 4) * kVec), 2 * (u % 4), f.p2, 3));
          hi = P512::or_(hi, place<P512>(P512::load(v + offp2 + ((u + Z2) / 4) * kVec), 2 * ((u + Z2) % 4), f.p2, 3));
        }
        if constexpr (f.p1 >= 0) {
          lo = P512::or_(lo, place<P512>(P512::load(v + offp1 + (u / 8) * kVec), u % 8, f.p1, 1));
          hi = P512::or_(hi, place<P512>(P512::load(v + offp1 + ((u + Z2) / 8) * kVec), (u + Z2) % 8, f.p1, 1));
        }
        if constexpr (f.lut) {
          lo = P512::lut(lo);
          hi = P512::lut(hi);
        }
        int32_t xl, xh;
        std::memcpy(&xl, xq + b * XQ + 4 * g, 4);
        std::memcpy(&xh, xq + (H + b) * XQ + 4 * g, 4);
        lo_sum = _mm512_dpbusd_epi32(lo_sum, lo, _mm512_set1_epi32(xl));
        hi_sum[b] = _mm512_dpbusd_epi32(hi_sum[b], hi, _mm512_set1_epi32(xh));
      }
      step(b, lo_sum);
    }
#pragma GCC unroll 8
    for (int b = 0; b < H; ++b) step(H + b, hi_sum[b]);
    xq += ns * XQ;
    xinit += ns * XI;
    if constexpr (f.min) xsum += ns * XI;
    xdx += XD;
  }
  _mm512_storeu_ps(acc, c);
}

// One activation row over chunks with a 1-bit plane (Q5_K): each chunk decoded whole into an L1 buffer
// (decode_values: the plane's shifts loop-invariant) and multiplied from there (tile_t); in registers (gemv_t,
// gemv1_t) it ran no faster on Zen 4.
template <Fmt f>
void gemv_dec1_t(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, float* acc) {
  constexpr int ns = f.qb / f.s;
  alignas(64) uint8_t buf[f.qb * kPanel + 2 * ns * kPanel * 4];
  const Dec d = dec_view(t, 1, buf);
  const int64_t cb = t.chunk_bytes();
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    qgemm::decode<P512>(t, packed + ch * cb, 1, d);  // prefetches ahead itself (qgemm_decode.h)
    tile_t<f.s, f.min, 1>(d, ns, a, ch * ns, r0, acc);
  }
}

// One activation row over Q6_K chunks, every weight vector built in registers: sub-blocks b and 8 + b (b < 8) take
// the low and high nibbles of units 4b..4b+3 and fields 0..3 of plane units b and 8 + b; one vpternlogd (bits 0..3
// from the nibble, 4..7 from the field) merges each. Sums and fp32 steps as gemv1_t's (K order: the high half's
// steps after the low half's). About half gemv_dec1_t's instructions (no stores, no reloads): 2x its rate from
// cache on Zen 4, and with the prefetch the same or more from DRAM.
void gemv1_q6k(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, float* acc) {
  constexpr int ns = 16, G = 4, H = 8, offp2 = 32 * kVec;
  const int64_t cb = t.chunk_bytes(), xstride = a.qi(r0, 1) - a.qi(r0, 0);
  alignas(64) float dw[16 * kPanel], mw[16 * kPanel];
  const __m512i m0f = _mm512_set1_epi8(0x0F), m33 = _mm512_set1_epi8(0x33);
  const __m512i mcc = _mm512_set1_epi8(static_cast<char>(0xCC));
  __m512 c = _mm512_loadu_ps(acc);
  auto step = [&](int64_t s, int j, __m512i isum) {
    const float dx = a.dx[a.di(r0, s * 16 / QK)];
    c = fp_step<false>(c, isum, _mm512_load_ps(dw + j * kPanel), _mm512_set1_ps(dx), nullptr, 0.0f);
  };
  auto dot = [](__m512i sum, __m512i w, const int8_t* x) {
    int32_t xv;
    std::memcpy(&xv, x, 4);
    return _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(xv));
  };
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const uint8_t* p = packed + ch * cb;
    prefetch_ahead(p, cb);  // at once: in H pieces (gemv1_t's way) it measured the same for Q6_K
    decode_scales<P512>(t, p, dw, mw);
    const uint8_t* v = p + t.scale_bytes();
    const int64_t s0 = ch * ns;
    const int8_t* xq = a.q + a.qi(r0, s0);
    __m512i hi_sum[H];
#pragma GCC unroll 8
    for (int b = 0; b < H; ++b) {
      const __m512i pl = P512::load(v + offp2 + b * kVec), ph = P512::load(v + offp2 + (H + b) * kVec);
      const __m512i ql = _mm512_and_si512(pl, m33), rl = _mm512_and_si512(pl, mcc);
      const __m512i qh = _mm512_and_si512(ph, m33), rh = _mm512_and_si512(ph, mcc);
      const __m512i f_lo[G] = {q6_field<P512, 0>(ql, rl), q6_field<P512, 1>(ql, rl), q6_field<P512, 2>(ql, rl),
                               q6_field<P512, 3>(ql, rl)};
      const __m512i f_hi[G] = {q6_field<P512, 0>(qh, rh), q6_field<P512, 1>(qh, rh), q6_field<P512, 2>(qh, rh),
                               q6_field<P512, 3>(qh, rh)};
      __m512i lo_sum = _mm512_set1_epi32(a.init[a.si(r0, s0 + b)]);
      hi_sum[b] = _mm512_set1_epi32(a.init[a.si(r0, s0 + H + b)]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512i n = P512::load(v + (b * G + g) * kVec);
        const __m512i lo = _mm512_ternarylogic_epi32(m0f, n, f_lo[g], 0xCA);  // m0f ? n : field
        const __m512i hi = _mm512_ternarylogic_epi32(m0f, _mm512_srli_epi16(n, 4), f_hi[g], 0xCA);
        lo_sum = dot(lo_sum, lo, xq + b * xstride + 4 * g);
        hi_sum[b] = dot(hi_sum[b], hi, xq + (H + b) * xstride + 4 * g);
      }
      step(s0 + b, b, lo_sum);
    }
#pragma GCC unroll 8
    for (int b = 0; b < H; ++b) step(s0 + H + b, H + b, hi_sum[b]);
  }
  _mm512_storeu_ps(acc, c);
}

using GemvFn = void (*)(const QType&, const uint8_t*, int64_t, const Act&, int64_t, float*);

template <Fmt f, int... R>
constexpr std::array<GemvFn, sizeof...(R)> gemvs(std::integer_sequence<int, R...>) {
  return {gemv_t<f, R + 1>...};
}

template <Fmt f>
GemvFn gemv_for(int64_t mr, int lt) {
  static constexpr auto table = gemvs<f>(std::make_integer_sequence<int, kMaxRows>());
  if constexpr (f.nib && f.qb == 256 && f.p2 == 4 && f.s == 16 && !f.min)  // Q6_K
    if (mr == 1) return gemv1_q6k;
  if constexpr (f.nib && f.qb == 256 && (f.p2 >= 0 || f.p1 >= 0))
    if (mr == 1) return gemv_dec1_t<f>;
  if constexpr (f.nib && f.qb == 256 && f.p2 < 0 && f.p1 < 0)
    if (mr == 1 && (lt == 0 || lt == 4))  // T = 1: a lone row; T = 16: the last row of a batch of 9 or more
      return lt == 0 ? gemv1_t<f, 0> : gemv1_t<f, 4>;
  return table[mr - 1];
}

GemvFn pick_gemv(int id, int64_t mr, int lt) {
  return with_fmt<GemvFn>(id, [mr, lt](auto tag) { return gemv_for<decltype(tag)::value>(mr, lt); });
}

void gemv_rows(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, int64_t mr,
               float* acc) {
  pick_gemv(t.id, mr, a.lt)(t, packed, nchunks, a, r0, acc);
}

}  // namespace

namespace avx512 {
void quantize_act(const QType& t, const float* x, int64_t ldx, int64_t r0, int64_t r1, const Act& a) {
  quantize_rows(t, x, ldx, r0, r1, a);
}
void decode(const QType& t, const uint8_t* packed, int64_t n, const Dec& d) { qgemm::decode<P512>(t, packed, n, d); }
void tile(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr, float* acc) {
  tile_rows(t, d, nsubs, a, s0, r0, mr, acc);
}
bool gemv(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, int64_t mr, float* acc) {
  gemv_rows(t, packed, nchunks, a, r0, mr, acc);  // every type and row count
  return true;
}
// Zen 4, 1.7B and 135M shapes, weights from memory: types of plain nibbles (Q4_0, Q4_1, Q4_K, IQ4_*) to 64 rows
// (0.68-0.84x at 12-16 rows, 0.90-0.92x at 32, 0.94-0.98x at 64); types with bit planes (Q5_*, Q6_K, Q2_K, Q3_K) and
// Q8_0 (its register path streams without a software prefetch: a 49152 x 576 lm_head 1.06-1.10x at 32-64 rows) to 16.
int64_t few_rows(const QType& t) { return t.nib && t.p1 < 0 && t.p2 < 0 ? 64 : 16; }
}  // namespace avx512

const Ops kAvx512Ops = {avx512::quantize_act, avx512::decode, avx512::tile, kMaxRows, avx512::gemv, avx512::few_rows,
                         nullptr, nullptr, nullptr, nullptr, tile2_rows, kMaxRows2};

}  // namespace pdserve::qgemm

#pragma GCC pop_options
#endif  // __x86_64__
