// Shared definitions of the native kernels: ISA levels, GGUF block layouts, half/bf16 conversions.
// This header has no torch dependency so the ISA-specific translation units compile fast.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace pdserve {

// Instruction-set levels, lowest first; each level includes every feature of the levels below it:
//   generic     portable C++
//   avx2        AVX2 + FMA + F16C
//   avx512      AVX-512 F/BW/VL/DQ + VNNI (vpdpbusd)
//   avx512_bf16 + AVX512-BF16 (vdpbf16ps)
//   amx         + AMX tiles with INT8 and BF16, granted by the OS (Linux arch_prctl XTILEDATA)
// A kernel family is an IsaTable (dispatch.h): the entry of the highest level at or below the active one that the
// family implements runs (generic is always implemented), so a family adds a level by adding one entry.
enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
constexpr int kNumIsa = 5;

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* out);  // false for an unknown name
bool cpu_supports(Isa isa);  // this CPU (and OS, for AMX) runs every feature of the level
Isa cpu_best_isa();          // the widest level this CPU runs
Isa active_isa();            // what kernels use now: cpu_best_isa() unless lowered with set_active_isa()
void set_active_isa(Isa isa);  // throws std::invalid_argument if the CPU lacks it

// GGUF/ggml block layouts (ggml-common.h). QK = 32 weights per block, scales are IEEE half.
constexpr int QK = 32;
struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };              // w = d * (q - 8)
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[QK / 2]; };  // w = d * q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };                    // w = d * q
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
// Q4 nibble order: qs[j] & 0xF is weight j, qs[j] >> 4 is weight j + 16.

// ggml type ids, as in the GGUF file.
enum class QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      mant &= 0x3FF;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t fp32_to_fp16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = x & 0x7FFFFF;
  if (((x >> 23) & 0xFF) == 0xFF) return static_cast<uint16_t>(sign | 0x7C00u | (mant ? 0x200u : 0u));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7C00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // may carry into the exponent: still correct
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_to_fp32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t fp32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

// Software prefetch of streamed weights into L2 (prefetcht1 on x86), this many bytes ahead of where a kernel reads:
// the decode GEMVs read each weight once, and a core's hardware prefetchers alone leave its share of DRAM bandwidth
// half used behind the kernels' arithmetic (BENCHMARKS.md, "prefetch"). PDSERVE_PREFETCH_BYTES overrides the
// distance at start-up (0 turns it off); set_stream_prefetch_bytes (benchmarks) changes it between calls.
inline int64_t g_stream_prefetch_bytes = [] {
  const char* v = std::getenv("PDSERVE_PREFETCH_BYTES");
  return v != nullptr ? std::atoll(v) : int64_t{6144};
}();

// [p + distance, p + distance + n) into L2, one hint per 64-byte line; p + distance may lie past the weight (a
// prefetch never faults).
inline void prefetch_ahead(const void* p, int64_t n) {
  const int64_t dist = g_stream_prefetch_bytes;
  if (dist <= 0) return;
  const char* f = static_cast<const char*>(p) + dist;
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(f + o, 0, 2);
}

}  // namespace pdserve
