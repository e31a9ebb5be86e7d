// Vector helpers shared by the AVX-512 kernel files. Include after `#pragma GCC target(...avx512...)`: the
// functions take that target.
#pragma once

#include <immintrin.h>

namespace pdserve::vec {

// 16 bf16 values widened to fp32 (exact: a bf16 is the top half of its fp32).
inline __m512 bf16_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// exp(x) as in Cephes expf: x = n*ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial, times 2^n (about 1 ulp).
// x is clamped to [-87.34, 88.38] so 2^n stays a normal float; callers mask lanes that must be exactly 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.336544f)), _mm512_set1_ps(88.376259f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// exp(x) for x <= 0 (softmax probabilities): 2^n * 2^f with n = round(x * log2(e)), f in [-1/2, 1/2], 2^f by a
// degree-5 fit (relative error ~1e-7, below fp32's rounding of x * log2(e) at |x| ~ 20) and vscalefps for 2^n: 10
// vector operations against exp16's 17. x below -87 (-inf included) gives 0; no upper clamp.
inline __m512 exp16_scalef(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3400432165362496e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.676037097870464e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503272142096285e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022107355830463e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472067106197e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000754953486f));
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result = op over the lanes of s[i] (op: an associative _mm512_*_ps): a transpose tree, 15 ops and
// 30 shuffles for 16 vectors.
template <class Op>
inline __m512 reduce16_with(const __m512* s, Op op) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = op(_mm512_unpacklo_ps(s[2 * k], s[2 * k + 1]), _mm512_unpackhi_ps(s[2 * k], s[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: partial sums of keys 4k..4k+3
    u[k] = op(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = op(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = op(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane i of the result = sum of the lanes of s[i].
inline __m512 reduce16(const __m512* s) {
  return reduce16_with(s, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

}  // namespace pdserve::vec
