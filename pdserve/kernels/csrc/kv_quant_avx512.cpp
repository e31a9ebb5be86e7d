// AVX-512 quantization of one K/V row for int8 and fp8 caches (kv_quant.h: the formats, and kv_quantize_row, the
// scalar definition these codes equal bit for bit): the row's absmax, its bf16 scale, then 16 codes a step.
#include "kv_quant.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace pdserve {
namespace {

// Codes of 16 values y (already divided by the scale and clamped to the format's max), as int32 lanes.
template <KVFormat F>
inline __m512i codes16(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  if constexpr (F == KVFormat::kInt8) {
    return _mm512_cvtps_epi32(_mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    using C = std::conditional_t<F == KVFormat::kFp8E4M3, Fp8E4M3, Fp8E5M2>;
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 a = _mm512_castsi512_ps(mag);
    const __m512i sub = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(C::kSubScale)),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m512i norm = _mm512_add_epi32(mag, _mm512_set1_epi32(C::kHalfMinus1));
    norm = _mm512_add_epi32(norm, _mm512_and_si512(_mm512_srli_epi32(mag, C::kShift), _mm512_set1_epi32(1)));
    norm = _mm512_sub_epi32(_mm512_srli_epi32(norm, C::kShift), _mm512_set1_epi32(C::kRebias));
    const __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, _mm512_set1_ps(C::kMinNormal), _CMP_LT_OQ),
                                                 norm, sub);
    return _mm512_or_si512(code, _mm512_srli_epi32(_mm512_andnot_si512(_mm512_set1_epi32(0x7FFFFFFF), bits), 24));
  }
}

template <KVFormat F>
void quantize_row(const float* x, int64_t d, uint8_t* dst) {
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 mx = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16)  // (|x| > mx) ? |x| : mx, as std::max(amax, |x|): a NaN is passed over
    mx = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + j)), absmask)),
                       mx);
  const uint16_t s16 = fp32_to_bf16(_mm512_reduce_max_ps(mx) / kv_code_max(F));
  const float s = bf16_to_fp32(s16);
  std::memcpy(dst + d, &s16, 2);
  if (!(s > 0.f)) {
    std::memset(dst, 0, d);
    return;
  }
  const __m512 sv = _mm512_set1_ps(s), lim = _mm512_set1_ps(kv_code_max(F)), nlim = _mm512_set1_ps(-kv_code_max(F));
  for (int64_t j = 0; j < d; j += 16) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + j), sv), nlim), lim);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm512_cvtepi32_epi8(codes16<F>(y)));
  }
}

}  // namespace

void kv_quantize_row_avx512(KVFormat f, const float* x, int64_t d, uint8_t* dst) {
  if (d % 16 != 0) return kv_quantize_row(f, x, d, dst);
  with_quantized_format(f, [&](auto fmt) { quantize_row<decltype(fmt)::value>(x, d, dst); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
