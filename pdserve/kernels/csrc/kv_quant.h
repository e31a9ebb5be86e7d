// KV cache storage formats (--kv-cache-dtype) and the scalar quantize / dequantize of one (token, KV head) row.
// No torch here: the ISA files include it.
//
// f32, bf16: a row is d values. int8, fp8 e4m3, fp8 e5m2: a row is d one-byte codes followed by its scale, a bf16
// (2 bytes, little endian; fp32's exponent range, so no row underflows it), so a row is d + 2 bytes and the cache tensor's last dimension is d + 2. The scale
// lives beside its codes so a block is self-contained: prefix caching, preemption and the PD hand-off copy blocks as
// bytes. Value = scale * decode(code):
//   int8: code in [-127, 127], scale = bf16(absmax / 127)   (symmetric, as llama.cpp's q8_0, one scale per row)
//   e4m3: code an fp8 e4m3fn (max 448),    scale = bf16(absmax / 448)
//   e5m2: code an fp8 e5m2 (max 57344),    scale = bf16(absmax / 57344)
// Codes are computed from the stored (rounded) scale, round to nearest even, saturated; a row of zeros stores
// scale 0 and codes 0. model/kv_cache_dtype.py is the PyTorch twin (bit-exact).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace pdserve {

enum class KVFormat : int32_t { kF32 = 0, kBF16 = 1, kInt8 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };

constexpr bool kv_quantized(KVFormat f) { return f == KVFormat::kInt8 || f == KVFormat::kFp8E4M3 || f == KVFormat::kFp8E5M2; }

// Bytes of one (token, KV head) row of head_dim d.
constexpr int64_t kv_row_bytes(KVFormat f, int64_t d) {
  return f == KVFormat::kF32 ? 4 * d : f == KVFormat::kBF16 ? 2 * d : d + 2;
}

// The largest magnitude a code holds (the scale maps the row's absmax onto it).
inline float kv_code_max(KVFormat f) {
  return f == KVFormat::kInt8 ? 127.f : f == KVFormat::kFp8E4M3 ? 448.f : 57344.f;
}

// fp8 codes decode as an IEEE half times a power of two (the vector kernels convert them with vcvtph2ps):
// e5m2 is the top byte of a half; e4m3's exponent and mantissa shifted under a half's read 2^-8 of the value (the
// biases differ by 8, subnormals included). The kernels fold kv_code_factor into the row's scale.
inline uint16_t fp8_to_half_bits(KVFormat f, uint8_t c) {
  if (f == KVFormat::kFp8E5M2) return static_cast<uint16_t>(c << 8);
  return static_cast<uint16_t>(((c & 0x80u) << 8) | ((c & 0x7Fu) << 7));
}
inline float kv_code_factor(KVFormat f) { return f == KVFormat::kFp8E4M3 ? 256.f : 1.f; }

inline float kv_decode(KVFormat f, uint8_t c) {
  if (f == KVFormat::kInt8) return static_cast<float>(static_cast<int8_t>(c));
  return fp16_to_fp32(fp8_to_half_bits(f, c)) * kv_code_factor(f);
}

// The fp8 code of |y| <= the format's max, by the bits of the float: below 2^emin (subnormal codes) |y| x
// 2^(mant - emin) rounded to nearest even; above, the float's exponent and mantissa rounded to mant bits (nearest
// even; a carry moves the exponent) and rebiased; the sign bit on top. fp8_code is the rule; the vector quantizers
// (kv_quant_avx512.cpp, kv_quant_avx2.cpp) apply it lane by lane.
template <int kMant, int kEmin, int kBias>
struct Fp8Code {
  static constexpr int kShift = 23 - kMant;
  static constexpr uint32_t kHalfMinus1 = (1u << (kShift - 1)) - 1;
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << kMant;
  static constexpr float kSubScale = static_cast<float>(1 << (kMant - kEmin));
  static constexpr float kMinNormal = 1.f / static_cast<float>(1 << -kEmin);
};
using Fp8E4M3 = Fp8Code<3, -6, 7>;
using Fp8E5M2 = Fp8Code<2, -14, 15>;

template <class C>
inline uint8_t fp8_code(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &mag, sizeof a);
  const uint32_t code = a < C::kMinNormal ? static_cast<uint32_t>(std::nearbyint(a * C::kSubScale))
                                          : ((mag + C::kHalfMinus1 + ((mag >> C::kShift) & 1u)) >> C::kShift) -
                                                C::kRebias;
  return static_cast<uint8_t>(code | ((bits >> 24) & 0x80u));
}

inline uint8_t kv_encode(KVFormat f, float x) {
  const float lim = kv_code_max(f);
  x = std::min(std::max(x, -lim), lim);
  if (f == KVFormat::kInt8) return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(x)));
  if (f == KVFormat::kFp8E4M3) return fp8_code<Fp8E4M3>(x);
  return fp8_code<Fp8E5M2>(x);
}

// One row: x[0..d) -> dst[0..d) codes, dst[d..d+2) the bf16 scale.
inline void kv_quantize_row(KVFormat f, const float* x, int64_t d, uint8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t s16 = fp32_to_bf16(amax / kv_code_max(f));
  const float s = bf16_to_fp32(s16);
  for (int64_t i = 0; i < d; ++i) dst[i] = s > 0.f ? kv_encode(f, x[i] / s) : 0;
  std::memcpy(dst + d, &s16, 2);
}

// kv_quantize_row's bits, 16 (avx512) or 8 (avx2) values a step for d a multiple of that (else the scalar row):
// kv_quant_avx512.cpp, kv_quant_avx2.cpp. A prefill writes hkv rows a token per layer and plane.
using KvQuantizeRowFn = void (*)(KVFormat f, const float* x, int64_t d, uint8_t* dst);
#if defined(__x86_64__)
void kv_quantize_row_avx2(KVFormat f, const float* x, int64_t d, uint8_t* dst);
void kv_quantize_row_avx512(KVFormat f, const float* x, int64_t d, uint8_t* dst);
#endif

// row(std::integral_constant<KVFormat, F>) for the quantized format f (int8, fp8 e4m3, fp8 e5m2).
template <class Row>
inline void with_quantized_format(KVFormat f, Row&& row) {
  if (f == KVFormat::kInt8) return row(std::integral_constant<KVFormat, KVFormat::kInt8>());
  if (f == KVFormat::kFp8E4M3) return row(std::integral_constant<KVFormat, KVFormat::kFp8E4M3>());
  row(std::integral_constant<KVFormat, KVFormat::kFp8E5M2>());
}

inline float kv_row_scale(const uint8_t* row, int64_t d) {
  uint16_t s16;
  std::memcpy(&s16, row + d, 2);
  return bf16_to_fp32(s16);
}

inline void kv_dequantize_row(KVFormat f, const uint8_t* row, int64_t d, float* out) {
  const float s = kv_row_scale(row, d);
  for (int64_t i = 0; i < d; ++i) out[i] = s * kv_decode(f, row[i]);
}

}  // namespace pdserve
