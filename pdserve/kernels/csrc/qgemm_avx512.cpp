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

// MR activation rows x the panel's 16 columns over nsubs sub-blocks. Per sub-block, each weight vector is loaded
// once and feeds every row (MR independent vpdpbusd chains; short tiles split each row's sum over more chains:
// integer adds, the same result), then each row takes the contract's fp32 steps.
template <int S, bool MIN, int MR>
void tile_t(const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  constexpr int G = S / 4, CH = MR <= 2 ? 4 : MR <= 4 ? 3 : 2;  // >= 10 chains of 5-cycle vpdpbusd
  __m512 c[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) c[r] = _mm512_loadu_ps(acc + r * kPanel);
  for (int64_t i = 0; i < nsubs; ++i) {
    const int64_t s = s0 + i;
    // rows r0..r0+MR share a 16-row tile: row r at constant offsets from these
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
    const uint8_t* wp = d.wq + i * G * kVec;
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512i w = _mm512_loadu_si512(wp + g * kVec);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        int32_t xv;
        std::memcpy(&xv, xi + r * S + 4 * g, 4);
        isum[r][g % CH] = _mm512_dpbusd_epi32(isum[r][g % CH], w, _mm512_set1_epi32(xv));
      }
    }
    const __m512 dws = _mm512_loadu_ps(d.dw + i * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m512i sum = isum[r][0];
      for (int h = 1; h < CH; ++h) sum = _mm512_add_epi32(sum, isum[r][h]);
      c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dws, _mm512_set1_ps(dx[r])), c[r]);
      if (MIN) c[r] = _mm512_fmadd_ps(_mm512_loadu_ps(d.mw + i * kPanel), _mm512_set1_ps(xs[r]), c[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kPanel, c[r]);
}

using TileFn = void (*)(const Dec&, int64_t, const Act&, int64_t, int64_t, float*);

template <int S, bool MIN, int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {tile_t<S, MIN, R + 1>...};
}

constexpr int kMaxRows = 8;

void tile_rows(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr, float* acc) {
  static constexpr auto k32 = tiles<32, false>(std::make_integer_sequence<int, kMaxRows>());
  static constexpr auto k32m = tiles<32, true>(std::make_integer_sequence<int, kMaxRows>());
  static constexpr auto k16 = tiles<16, false>(std::make_integer_sequence<int, kMaxRows>());
  static constexpr auto k16m = tiles<16, true>(std::make_integer_sequence<int, kMaxRows>());
  const auto& table = t.s == 32 ? (t.min ? k32m : k32) : (t.min ? k16m : k16);
  table[mr - 1](d, nsubs, a, s0, r0, acc);
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
}  // namespace avx512

const Ops kAvx512Ops = {avx512::quantize_act, avx512::decode, avx512::tile, kMaxRows, nullptr, nullptr, nullptr};

}  // namespace pdserve::qgemm

#pragma GCC pop_options
#endif  // __x86_64__
