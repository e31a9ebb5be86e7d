// AVX2 qgemm kernels: a panel's 16 columns as two ymm of 8 lanes; vpmaddubsw (u8 weights x s8 activations ->
// int16 pairs) then vpmaddwd by ones -> int32. No int16 saturation: activations are within +-127 and unsigned
// weights below 64, so two maddubs results (2 * 2 * 63 * 127 = 32004) still fit before the widening; the signed
// 8-bit types (off = 128: Q8_0, IQ4_*) take llama.cpp's sign trick, |w| x sign(x, w) (2 * 128 * 127 = 32512), and
// sum q*x directly (the same int32 as the other levels' init + sum u*x). The fp32 steps are qgemm_generic.cpp's.
#if defined(__x86_64__)
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "qgemm_decode.h"

namespace pdserve::qgemm {
namespace {

struct P256 {
  struct V { __m256i a, b; };
  struct F { __m256 a, b; };
  static __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V load(const uint8_t* p) { return {ld(p), ld(p + 32)}; }
  static void store(uint8_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v.a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), v.b);
  }
  static V zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static V and8(V v, uint8_t m) {
    const __m256i mm = _mm256_set1_epi8(static_cast<char>(m));
    return {_mm256_and_si256(v.a, mm), _mm256_and_si256(v.b, mm)};
  }
  static V or_(V x, V y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
  static V srl(V v, int n) {
    const __m128i c = _mm_cvtsi32_si128(n);
    return {_mm256_srl_epi16(v.a, c), _mm256_srl_epi16(v.b, c)};
  }
  static V sll(V v, int n) {
    const __m128i c = _mm_cvtsi32_si128(n);
    return {_mm256_sll_epi16(v.a, c), _mm256_sll_epi16(v.b, c)};
  }
  static __m256i sll(__m256i v, int n) { return _mm256_sll_epi16(v, _mm_cvtsi32_si128(n)); }  // one half
  static __m256i srl(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
  static V lut(V v) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Table)));
    return {_mm256_shuffle_epi8(t, v.a), _mm256_shuffle_epi8(t, v.b)};
  }
  static __m256 h8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F half(const uint8_t* p) { return {h8(p), h8(p + 16)}; }
  static __m256i b8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static __m256i sb8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static F u8(const uint8_t* p) { return {_mm256_cvtepi32_ps(b8(p)), _mm256_cvtepi32_ps(b8(p + 8))}; }
  static F s8(const uint8_t* p) { return {_mm256_cvtepi32_ps(sb8(p)), _mm256_cvtepi32_ps(sb8(p + 8))}; }
  static F lo4(const uint8_t* p) {
    const __m256i m = _mm256_set1_epi32(15);
    return {_mm256_cvtepi32_ps(_mm256_and_si256(b8(p), m)), _mm256_cvtepi32_ps(_mm256_and_si256(b8(p + 8), m))};
  }
  static F hi4(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_srli_epi32(b8(p), 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b8(p + 8), 4))};
  }
  static F mul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static F neg(F x) {
    const __m256 s = _mm256_set1_ps(-0.0f);
    return {_mm256_xor_ps(x.a, s), _mm256_xor_ps(x.b, s)};
  }
  static void store(float* p, F f) {
    _mm256_storeu_ps(p, f.a);
    _mm256_storeu_ps(p + 8, f.b);
  }
};

int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// As qgemm_generic.cpp's quantize_act: d = amax/127, q = round half to even (x * (1/d)).
void quantize_rows(const QType& t, const float* x, int64_t ldx, int64_t r0, int64_t r1, const Act& a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < a.nb32; ++b) {
      const float* xb = x + r * ldx + b * QK;
      __m256 v[4], mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      const float d = hmax(mx) / 127.0f;
      const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      alignas(32) int8_t qb[QK];
      _mm256_store_si256(reinterpret_cast<__m256i*>(qb),
                         _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      int32_t sums[2];
      if (t.s == QK) {
        sums[0] = hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      } else {
        sums[0] = hsum(_mm256_add_epi32(q[0], q[1]));
        sums[1] = hsum(_mm256_add_epi32(q[2], q[3]));
      }
      put_block(t, a, r, b, qb, d, sums);
    }
  }
}

// The exact int32 sums of one sub-block for 8 columns (wq: the half's weight vectors, stride 64 bytes).
template <int G, bool SGN>
inline __m256i dot8(const uint8_t* wq, const int8_t* x, int32_t init) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = SGN ? _mm256_setzero_si256() : _mm256_set1_epi32(init);
  for (int g = 0; g < G; g += SGN ? 1 : 2) {
    int32_t x0;
    std::memcpy(&x0, x + 4 * g, 4);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + g * kVec));
    __m256i p;
    if constexpr (SGN) {
      const __m256i ws = _mm256_xor_si256(w0, _mm256_set1_epi8(static_cast<char>(0x80)));
      p = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(_mm256_set1_epi32(x0), ws));
    } else {
      int32_t x1;
      std::memcpy(&x1, x + 4 * g + 4, 4);
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (g + 1) * kVec));
      p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(x0)),
                           _mm256_maddubs_epi16(w1, _mm256_set1_epi32(x1)));
    }
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  }
  return acc;
}

template <int S, bool MIN, bool SGN, int MR>
void tile_t(const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc) {
  constexpr int G = S / 4;
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) c[r][h] = _mm256_loadu_ps(acc + r * kPanel + 8 * h);
  for (int64_t i = 0; i < nsubs; ++i) {
    const int64_t s = s0 + i;
    const int8_t* x = a.q + a.qi(r0, s);  // row r at x + r * S (rows r0..r0+MR share one of Act's tiles)
    const float* dx = a.dx + a.di(r0, s * S / QK);
    const int32_t* init = a.init + a.si(r0, s);
    const float* xs = a.xs + a.si(r0, s);
    for (int r = 0; r < MR; ++r) {
      const __m256 dxr = _mm256_set1_ps(dx[r]);
      for (int h = 0; h < 2; ++h) {
        const __m256i isum = dot8<G, SGN>(d.wq + i * G * kVec + 32 * h, x + r * S, init[r]);
        const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(d.dw + i * kPanel + 8 * h), dxr);
        c[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), p, c[r][h]);
        if (MIN)
          c[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(d.mw + i * kPanel + 8 * h), _mm256_set1_ps(xs[r]), c[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * kPanel + 8 * h, c[r][h]);
}

using TileFn = void (*)(const Dec&, int64_t, const Act&, int64_t, int64_t, float*);
constexpr int kMaxRows = 4;

template <int S, bool MIN, bool SGN, int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {tile_t<S, MIN, SGN, R + 1>...};
}

void tile_rows(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr, float* acc) {
  using Seq = std::make_integer_sequence<int, kMaxRows>;
  static constexpr auto k32 = tiles<32, false, false>(Seq()), k32m = tiles<32, true, false>(Seq());
  static constexpr auto k32s = tiles<32, false, true>(Seq());
  static constexpr auto k16 = tiles<16, false, false>(Seq()), k16m = tiles<16, true, false>(Seq());
  const auto& table = t.off == 128 ? k32s : t.s == 32 ? (t.min ? k32m : k32) : (t.min ? k16m : k16);
  table[mr - 1](d, nsubs, a, s0, r0, acc);
}

// 1-4 activation rows straight from the packed panel, each weight vector built in registers (the 16 columns as two
// ymm, one half at a time) and used at once: no store and reload of a decoded chunk (one row of Q6_K: gemv1_q6k
// below). Integer sums are exact, so summing more maddubs results in int16 before the widening (as many as cannot
// overflow: 8 for 4-bit weights, 4 for 5-bit, 2 for 6-bit) leaves them unchanged; the fp32 steps are tile_t's.

// maddubs results of one row summed in int16 before the widening: the most (a power of two dividing the G weight
// vectors of a sub-block) whose sum cannot overflow, 2 x U x 127 each with U the largest unsigned weight.
template <Fmt f>
constexpr int int16_sums() {
  const int bits = (f.nib ? 4 : 0) + (f.p2 >= 0 ? 2 : 0) + (f.p1 >= 0 ? 1 : 0);
  const int most = 32767 / (2 * ((1 << bits) - 1) * 127);
  int a = f.s / 4;
  while (a > most) a /= 2;
  return a;
}

template <Fmt f, int MR>
void gemv_t(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, float* acc) {
  constexpr bool SGN = f.raw || f.lut;  // signed bytes: the sign trick, one maddubs per widening
  constexpr int G = f.s / 4, ns = f.qb / f.s, A = SGN ? 1 : int16_sums<f>();
  const int64_t cb = t.chunk_bytes();
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) float dw[16 * kPanel], mw[16 * kPanel];
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) c[r][h] = _mm256_loadu_ps(acc + r * kPanel + 8 * h);
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const uint8_t* p = packed + ch * cb;
    if constexpr (!f.raw) prefetch_ahead(p, cb);
    decode_scales<P256>(t, p, dw, mw);
    const uint8_t* v = p + t.scale_bytes();
    for (int j = 0; j < ns; ++j) {
      // rows r0..r0+MR share one of Act's tiles: row r at constant offsets from these
      const int64_t s = ch * ns + j;
      const int8_t* x = a.q + a.qi(r0, s);
      const float* dx = a.dx + a.di(r0, s * f.s / QK);
      const int32_t* init = a.init + a.si(r0, s);
      const float* xs = a.xs + a.si(r0, s);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // columns 8h..8h+7
        __m256i isum[MR];
        for (int r = 0; r < MR; ++r) isum[r] = SGN ? _mm256_setzero_si256() : _mm256_set1_epi32(init[r]);
        for (int g0 = 0; g0 < G; g0 += A) {
          __m256i p16[MR];
          for (int r = 0; r < MR; ++r) p16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int g = g0; g < g0 + A; ++g) {
            const P256::V wv = weight_vector<P256, f>(v, j * G + g);  // columns 0-7, 8-15
            const __m256i w = h == 0 ? wv.a : wv.b;
            const __m256i ws = SGN ? _mm256_xor_si256(w, flip) : w, wa = SGN ? _mm256_abs_epi8(ws) : w;
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
              int32_t xv;
              std::memcpy(&xv, x + r * f.s + 4 * g, 4);
              const __m256i xb = _mm256_set1_epi32(xv);
              if constexpr (SGN)
                p16[r] = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xb, ws));
              else
                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(w, xb));
            }
          }
          for (int r = 0; r < MR; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], ones));
        }
        const __m256 dwh = _mm256_load_ps(dw + j * kPanel + 8 * h);
        for (int r = 0; r < MR; ++r) {
          c[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dwh, _mm256_set1_ps(dx[r])), c[r][h]);
          if constexpr (f.min)
            c[r][h] = _mm256_fmadd_ps(_mm256_load_ps(mw + j * kPanel + 8 * h), _mm256_set1_ps(xs[r]), c[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * kPanel + 8 * h, c[r][h]);
}

// One activation row over Q6_K chunks, every weight vector built in registers: sub-block j takes nibbles (low for
// j < 8, high after) of units 4(j % 8)..4(j % 8) + 3 and fields 0..3 of plane unit j, merged as (nibble & 0x0F) |
// (field & 0xF0). 6-bit weights: two maddubs per widening (2 x 2 x 63 x 127 < 2^15). Sub-blocks in K order, the
// fp32 steps tile_t's.
void gemv1_q6k(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, float* acc) {
  constexpr int ns = 16, G = 4, H = 8, offp2 = 32 * kVec;
  const int64_t cb = t.chunk_bytes();
  alignas(32) float dw[16 * kPanel], mw[16 * kPanel];
  const __m256i m0f = _mm256_set1_epi8(0x0F), m33 = _mm256_set1_epi8(0x33);
  const __m256i mcc = _mm256_set1_epi8(static_cast<char>(0xCC)), ones = _mm256_set1_epi16(1);
  __m256 c[2] = {_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8)};
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const uint8_t* p = packed + ch * cb;
    prefetch_ahead(p, cb);
    decode_scales<P256>(t, p, dw, mw);
    const uint8_t* v = p + t.scale_bytes();
    for (int j = 0; j < ns; ++j) {
      const int64_t s = ch * ns + j;
      const int8_t* x = a.q + a.qi(r0, s);
      const int b = j % H;
      const __m256 dxr = _mm256_set1_ps(a.dx[a.di(r0, s * 16 / QK)]);
      const __m256i init = _mm256_set1_epi32(a.init[a.si(r0, s)]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // columns 8h..8h+7
        const uint8_t* vh = v + 32 * h;
        const __m256i pl = P256::ld(vh + offp2 + j * kVec);
        const __m256i q = _mm256_and_si256(pl, m33), r = _mm256_and_si256(pl, mcc);
        const __m256i f[G] = {q6_field<P256, 0>(q, r), q6_field<P256, 1>(q, r), q6_field<P256, 2>(q, r),
                              q6_field<P256, 3>(q, r)};
        __m256i isum = init;
#pragma GCC unroll 2
        for (int g0 = 0; g0 < G; g0 += 2) {
          __m256i p16 = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int g = g0; g < g0 + 2; ++g) {
            __m256i n = P256::ld(vh + (b * G + g) * kVec);
            if (j >= H) n = _mm256_srli_epi16(n, 4);
            const __m256i w = _mm256_or_si256(_mm256_and_si256(n, m0f), _mm256_andnot_si256(m0f, f[g]));
            int32_t xv;
            std::memcpy(&xv, x + 4 * g, 4);
            p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(xv)));
          }
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, ones));
        }
        c[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_load_ps(dw + j * kPanel + 8 * h), dxr),
                               c[h]);
      }
    }
  }
  _mm256_storeu_ps(acc, c[0]);
  _mm256_storeu_ps(acc + 8, c[1]);
}

using GemvFn = void (*)(const QType&, const uint8_t*, int64_t, const Act&, int64_t, float*);

// The register GEMV of format f for mr rows, or null (decode's L1 pass). 32-value chunks (Q4_0, Q4_1, Q5_*, Q8_0,
// IQ4_NL) up to 2 rows: at 4 their per-chunk scale decoding and spilled accumulators cost more than the L1 pass
// (Zen 4, one thread: 0.92x). One row of Q6_K: gemv1_q6k.
template <Fmt f>
GemvFn gemv_for(int64_t mr) {
  static constexpr GemvFn table[kMaxRows] = {gemv_t<f, 1>, gemv_t<f, 2>, gemv_t<f, 3>, gemv_t<f, 4>};
  if constexpr (f.nib && f.qb == 256 && f.p2 == 4 && f.s == 16 && !f.min)  // Q6_K
    if (mr == 1) return gemv1_q6k;
  return f.qb == 32 && mr > 2 ? nullptr : table[mr - 1];
}

GemvFn pick_gemv(int id, int64_t mr) {
  return with_fmt<GemvFn>(id, [mr](auto tag) { return gemv_for<decltype(tag)::value>(mr); });
}

// Ops::gemv: the types and row counts pick_gemv has in registers; false leaves the rest to decode + tile.
bool gemv_rows(const QType& t, const uint8_t* packed, int64_t nchunks, const Act& a, int64_t r0, int64_t mr,
               float* acc) {
  const GemvFn fn = pick_gemv(t.id, mr);
  if (fn) fn(t, packed, nchunks, a, r0, acc);
  return fn != nullptr;
}

}  // namespace

// Ops::few_rows on this level (Zen 4 at the avx2 level, 1.7B shapes): Q4_K/IQ4_XS, whose 4-row GEMV is in
// registers, to 64 rows (0.71x at 8, 0.93x at 64); the 32-value types, whose row tiles share each 256-value L1 decode
// instead, to 16 (0.86-0.95x; 64 rows: 1.03x); types with bit planes not past max_rows (Q6_K at 16 rows: 1.19x).
int64_t few_rows(const QType& t) { return t.p1 >= 0 || t.p2 >= 0 ? kMaxRows : t.qb == 256 ? 64 : 16; }

const Ops kAvx2Ops = {quantize_rows, decode<P256>, tile_rows, kMaxRows, gemv_rows, few_rows, nullptr, nullptr, nullptr,
                      nullptr};

}  // namespace pdserve::qgemm

#pragma GCC pop_options
#endif  // __x86_64__
