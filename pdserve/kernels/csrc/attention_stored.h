// A stored K/V row's elements as floats, for the AVX-512 attention kernels (attention_avx512.cpp reads them in place
// or widened, attention_bf16.h converts quantized rows to bf16 tiles). Include after a `#pragma GCC target` with
// avx512f, bw, vl and f16c.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kv_quant.h"
#include "vec_avx512.h"

namespace pdserve {

// Elements j .. j + 15 of a stored bf16 or quantized row (kv_quant.h) as floats, unscaled: exact (bf16 shifted into
// an f32; int8 sign-extended; fp8 through its half bits, vcvtph2ps), so reading in place or widening into a buffer
// first gives the same arithmetic.
template <KVFormat F>
inline __m512 stored16(const uint8_t* row, int j) {
  if constexpr (F == KVFormat::kBF16) {
    return vec::bf16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * j)));
  } else {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j));
    if constexpr (F == KVFormat::kInt8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
    } else {
      __m256i h = _mm256_cvtepu8_epi16(c);
      if constexpr (F == KVFormat::kFp8E5M2) {
        h = _mm256_slli_epi16(h, 8);
      } else {
        h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                            _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
      }
      return _mm512_cvtph_ps(h);
    }
  }
}

}  // namespace pdserve
