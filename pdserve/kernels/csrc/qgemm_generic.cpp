// Portable qgemm kernels: the reference every SIMD level must match bit for bit (same int32 sub-block sums, same
// fp32 operation sequence, see qgemm.h), plus the activation quantizer and the dequantizer shared by all levels.
// Products and sums are never contracted into FMAs except where the contract says fma.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "qgemm.h"

#pragma GCC optimize("fp-contract=off")

#include "qgemm_decode.h"

namespace pdserve::qgemm {
namespace {

// 64-byte units as eight uint64 words (SWAR: byte masks after every shift keep bytes apart).
struct PGeneric {
  struct V { uint64_t w[8]; };
  struct F { float f[16]; };
  static constexpr uint64_t kOnes = 0x0101010101010101ull;
  static V load(const uint8_t* p) { V v; std::memcpy(v.w, p, 64); return v; }
  static void store(uint8_t* p, const V& v) { std::memcpy(p, v.w, 64); }
  static V zero() { return V{}; }
  static V and8(V v, uint8_t m) { for (auto& x : v.w) x &= kOnes * m; return v; }
  static V or_(V a, const V& b) { for (int i = 0; i < 8; ++i) a.w[i] |= b.w[i]; return a; }
  static V srl(V v, int n) { for (auto& x : v.w) x >>= n; return v; }
  static V sll(V v, int n) { for (auto& x : v.w) x <<= n; return v; }
  static V lut(const V& v) {
    uint8_t b[64];
    std::memcpy(b, v.w, 64);
    for (auto& x : b) x = kIq4Table[x & 0xF];
    return load(b);
  }
  static F half(const uint8_t* p) {
    F f;
    for (int i = 0; i < 16; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      f.f[i] = fp16_to_fp32(h);
    }
    return f;
  }
  template <class Fn> static F map(const uint8_t* p, Fn fn) { F f; for (int i = 0; i < 16; ++i) f.f[i] = fn(p[i]); return f; }
  static F u8(const uint8_t* p) { return map(p, [](uint8_t b) { return static_cast<float>(b); }); }
  static F s8(const uint8_t* p) { return map(p, [](uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }); }
  static F lo4(const uint8_t* p) { return map(p, [](uint8_t b) { return static_cast<float>(b & 0xF); }); }
  static F hi4(const uint8_t* p) { return map(p, [](uint8_t b) { return static_cast<float>(b >> 4); }); }
  static F mul(F a, const F& b) { for (int i = 0; i < 16; ++i) a.f[i] *= b.f[i]; return a; }
  static F neg(F a) { for (auto& x : a.f) x = -x; return a; }
  static void store(float* p, const F& f) { std::memcpy(p, f.f, sizeof f.f); }
};

void quantize_act(const QType& t, const float* x, int64_t ldx, int64_t r0, int64_t r1, const Act& a) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < a.nb32; ++b) {
      const float* xb = x + r * ldx + b * QK;
      float amax = 0.0f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t q[QK];
      int32_t sums[2] = {0, 0};
      for (int j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));  // round half to even
        q[j] = static_cast<int8_t>(v);
        sums[j / t.s] += v;
      }
      put_block(t, a, r, b, q, d, sums);
    }
  }
}

void tile(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr, float* acc) {
  const int s = t.s;
  for (int64_t r = 0; r < mr; ++r) {
    const int64_t row = r0 + r;
    for (int64_t i = 0; i < nsubs; ++i) {
      const int64_t sub = s0 + i;
      const int8_t* x = a.q + a.qi(row, sub);
      const uint8_t* w = d.wq + i * s * kPanel;
      const float dx = a.dx[a.di(row, sub * s / QK)];
      const int32_t init = a.init[a.si(row, sub)];
      for (int c = 0; c < kPanel; ++c) {
        int32_t isum = init;
        for (int g = 0; g < s / 4; ++g)
          for (int j = 0; j < 4; ++j) isum += w[g * kVec + 4 * c + j] * x[4 * g + j];
        const float p = d.dw[i * kPanel + c] * dx;
        float v = std::fma(static_cast<float>(isum), p, acc[r * kPanel + c]);
        if (t.min) v = std::fma(d.mw[i * kPanel + c], a.xs[a.si(row, sub)], v);
        acc[r * kPanel + c] = v;
      }
    }
  }
}

}  // namespace

void dequant_decoded(const QType& t, const Dec& d, int64_t n, int c0, int c1, float* out, int64_t ldo) {
  const int64_t kk = n * t.qb;
  for (int c = c0; c < c1; ++c) {
    float* o = out + (c - c0) * ldo;
    for (int64_t k = 0; k < kk; k += 4) {
      const uint8_t* u = d.wq + (k / 4) * kVec + 4 * c;
      const int64_t i = (k / t.s) * kPanel + c;  // a sub-block holds whole groups of 4
      for (int j = 0; j < 4; ++j) {
        const float w = d.dw[i] * static_cast<float>(u[j] - t.off);
        o[k + j] = t.min ? w + d.mw[i] : w;
      }
    }
  }
}

const Ops kGenericOps = {quantize_act, decode<PGeneric>, tile, 8, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace pdserve::qgemm
