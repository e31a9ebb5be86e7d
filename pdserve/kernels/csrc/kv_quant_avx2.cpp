// AVX2 quantization of one K/V row for int8 and fp8 caches: kv_quant_avx512.cpp's steps, 8 values a step (the same
// codes as kv_quant.h's scalar kv_quantize_row).
#include "kv_quant.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace pdserve {
namespace {

template <KVFormat F>
inline __m256i codes8(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  if constexpr (F == KVFormat::kInt8) {
    return _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    using C = std::conditional_t<F == KVFormat::kFp8E4M3, Fp8E4M3, Fp8E5M2>;
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256 a = _mm256_castsi256_ps(mag);
    const __m256i sub = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(C::kSubScale)),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i norm = _mm256_add_epi32(mag, _mm256_set1_epi32(C::kHalfMinus1));
    norm = _mm256_add_epi32(norm, _mm256_and_si256(_mm256_srli_epi32(mag, C::kShift), _mm256_set1_epi32(1)));
    norm = _mm256_sub_epi32(_mm256_srli_epi32(norm, C::kShift), _mm256_set1_epi32(C::kRebias));
    const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(C::kMinNormal), _CMP_LT_OQ);
    const __m256i code = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(norm), _mm256_castsi256_ps(sub), is_sub));
    return _mm256_or_si256(code, _mm256_srli_epi32(_mm256_andnot_si256(_mm256_set1_epi32(0x7FFFFFFF), bits), 24));
  }
}

template <KVFormat F>
void quantize_row(const float* x, int64_t d, uint8_t* dst) {
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8)  // (|x| > mx) ? |x| : mx, as std::max(amax, |x|): a NaN is passed over
    mx = _mm256_max_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + j)), absmask)),
                       mx);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const uint16_t s16 = fp32_to_bf16(_mm_cvtss_f32(m4) / kv_code_max(F));
  const float s = bf16_to_fp32(s16);
  std::memcpy(dst + d, &s16, 2);
  if (!(s > 0.f)) {
    std::memset(dst, 0, d);
    return;
  }
  const __m256 sv = _mm256_set1_ps(s), lim = _mm256_set1_ps(kv_code_max(F)), nlim = _mm256_set1_ps(-kv_code_max(F));
  for (int64_t j = 0; j < d; j += 8) {
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + j), sv), nlim), lim);
    const __m256i c = codes8<F>(y);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    // int8 codes are signed (-127..127), fp8 codes bytes (0..255)
    const __m128i b = F == KVFormat::kInt8 ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + j), b);
  }
}

}  // namespace

void kv_quantize_row_avx2(KVFormat f, const float* x, int64_t d, uint8_t* dst) {
  if (d % 8 != 0) return kv_quantize_row(f, x, d, dst);
  with_quantized_format(f, [&](auto fmt) { quantize_row<decltype(fmt)::value>(x, d, dst); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
