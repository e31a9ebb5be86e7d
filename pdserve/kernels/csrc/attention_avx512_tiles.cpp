// AVX-512 paged attention for prompt rows with fp32 FMAs, head_dim 64 and 128, every cache format: the GEMM-shaped
// walk of the bf16 dot-product kernels (attention_tiles.h) for CPUs without them, or for f32 caches. Per key tile
// (32 keys) the K rows are widened to fp32 and transposed once into K^T [d][32] and the V rows widened into
// [32][d] (quantized rows scaled: code x scale is exact in fp32), shared by every row block of the item:
//   S = (q * scale) . K^T       4 rows share each K^T load, two chains per row and key half (even and odd d)
//   online softmax per row (attn_tiles::softmax_block), p in fp32
//   acc = acc * alpha + P . V   4 rows share each V load, one chain per row and 16-dim panel, keys in order
// A row's chains and their order do not depend on how many rows share the loads: the same bits whatever the batch.
// Against attention_avx512.cpp's walk (per row: 16 keys' dot products reduced by a transpose tree, then P . V by
// broadcasts of each key's V row), a product here costs one FMA and a fraction of a load.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

#include "attention_stored.h"
#include "attention_tiles.h"

namespace pdserve {
namespace {

using attn_tiles::kNegInf;
using attn_tiles::kTile;

struct Scratch {
  std::vector<float> q;            // [rows, padded to 16][d]: q * scale (padding rows zero)
  std::vector<float> kt, v;        // the key tile: K^T [d][32], V [32][d] (keys past the tile's end zero)
  std::vector<float> acc, m, l16;  // per row: [d], max, 16 lane-wise sums
  std::vector<int64_t> last;       // per row: it sees keys <= last (padding: -1)
  std::vector<float> s, p;         // a row block's scores and probabilities [16][32]
};

template <int D>
void prepare(const AttnArgs& a, const AttnItem& it, Scratch& s, int64_t rows) {
  const int64_t g = a.hq / a.hkv, padded = (rows + 15) / 16 * 16;
  s.q.assign(padded * D, 0.f);
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + (it.t0 + r / g) * a.q_stride + (it.kvh * g + r % g) * D;
    for (int j = 0; j < D; j += 16)
      _mm512_storeu_ps(s.q.data() + r * D + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), sc));
  }
  s.acc.assign(padded * D, 0.f);
  s.m.assign(padded, kNegInf);
  s.l16.assign(padded * 16, 0.f);
  s.last.resize(padded);
  for (int64_t r = 0; r < padded; ++r) s.last[r] = r < rows ? it.pos0 + r / g : -1;
  s.kt.resize(D * kTile);
  s.v.resize(kTile * D);
  s.s.resize(16 * kTile);
  s.p.resize(16 * kTile);
}

// Stored row `row` of format F as d floats into out (quantized: code x the row's scale).
template <int D, KVFormat F>
void widen_row(const uint8_t* row, float* out) {
  if constexpr (F == KVFormat::kF32) {
    std::memcpy(out, row, D * sizeof(float));
  } else {
    const __m512 sc = _mm512_set1_ps(F == KVFormat::kBF16 ? 1.f : kv_row_scale(row, D) * kv_code_factor(F));
    for (int j = 0; j < D; j += 16) _mm512_storeu_ps(out + j, _mm512_mul_ps(stored16<F>(row, j), sc));
  }
}

// K^T and V of keys kt .. kt + n - 1 (n <= 32; missing keys zero). K rows go through s.v, then V lands there.
template <int D, KVFormat F>
void prepare_kv(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, Scratch& s) {
  float* rows = s.v.data();
  for (int i = 0; i < kTile; ++i) {
    if (i < n) widen_row<D, F>(attn_tiles::stored_row(a, it, 0, kt + i), rows + i * D);
    else std::fill_n(rows + i * D, D, 0.f);
  }
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < D / 16; ++c) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows + (16 * h + j) * D + 16 * c);
      attn_tiles::transpose16(r);  // r[j]: dim 16c + j of keys 16h .. 16h + 15
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(s.kt.data() + (16 * c + j) * kTile + 16 * h, r[j]);
    }
  for (int i = 0; i < n; ++i) widen_row<D, F>(attn_tiles::stored_row(a, it, 1, kt + i), rows + i * D);
}

// Scores of rows i .. i + R - 1 of row block b against the tile into s.s: two chains per row and key half (even and
// odd d, added at the end), so a score's rounding grows with d / 2 terms, not d.
template <int D, int R>
void scores(Scratch& s, int64_t b, int i) {
  __m512 s0[R], s1[R], t0[R], t1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = t0[r] = t1[r] = _mm512_setzero_ps();
  const float* q = s.q.data() + (16 * b + i) * D;
  const float* k = s.kt.data();
#pragma GCC unroll 4
  for (int d = 0; d < D; d += 2) {
    const __m512 ka = _mm512_loadu_ps(k + d * kTile), kb = _mm512_loadu_ps(k + d * kTile + 16);
    const __m512 kc = _mm512_loadu_ps(k + (d + 1) * kTile), kd = _mm512_loadu_ps(k + (d + 1) * kTile + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]), y = _mm512_set1_ps(q[r * D + d + 1]);
      s0[r] = _mm512_fmadd_ps(x, ka, s0[r]);
      s1[r] = _mm512_fmadd_ps(x, kb, s1[r]);
      t0[r] = _mm512_fmadd_ps(y, kc, t0[r]);
      t1[r] = _mm512_fmadd_ps(y, kd, t1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s.s.data() + 32 * (i + r), _mm512_add_ps(s0[r], t0[r]));
    _mm512_storeu_ps(s.s.data() + 32 * (i + r) + 16, _mm512_add_ps(s1[r], t1[r]));
  }
}

// acc rows i .. i + R - 1 of block b (each seeing the tile) = acc * alpha + P . V over the tile's n keys, four
// 16-dim panels a pass.
template <int D, int R>
void pv_rows(Scratch& s, int64_t b, int i, int n, const float* alpha) {
  constexpr int NV = D / 16, H = NV < 4 ? NV : 4;
  for (int c0 = 0; c0 < NV; c0 += H) {
    __m512 o[R][H];
    for (int r = 0; r < R; ++r) {
      const float* acc = s.acc.data() + (16 * b + i + r) * D + 16 * c0;
      const __m512 al = _mm512_set1_ps(alpha[i + r]);
      for (int h = 0; h < H; ++h) o[r][h] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * h), al);
    }
    const float* v = s.v.data() + 16 * c0;
#pragma GCC unroll 4
    for (int k = 0; k < n; ++k) {
      __m512 vv[H];
      for (int h = 0; h < H; ++h) vv[h] = _mm512_loadu_ps(v + k * D + 16 * h);
      for (int r = 0; r < R; ++r) {
        const __m512 pk = _mm512_set1_ps(s.p[32 * (i + r) + k]);
        for (int h = 0; h < H; ++h) o[r][h] = _mm512_fmadd_ps(pk, vv[h], o[r][h]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) _mm512_storeu_ps(s.acc.data() + (16 * b + i + r) * D + 16 * (c0 + h), o[r][h]);
  }
}

template <int D, KVFormat F>
void run(const AttnArgs& a, const AttnItem& it) {
  thread_local Scratch s;
  const int64_t rows = (it.t1 - it.t0) * (a.hq / a.hkv);
  prepare<D>(a, it, s, rows);
  alignas(64) float alpha[16];
  attn_tiles::walk(
      a, it, rows, [&](int64_t kt, int n) { prepare_kv<D, F>(a, it, kt, n, s); },
      [&](int64_t b, int64_t kt, int n) {
        int i = 0;
        for (; i + 3 < 16 && 16 * b + i + 3 < rows; i += 4) scores<D, 4>(s, b, i);
        for (; i < 16 && 16 * b + i < rows; ++i) scores<D, 1>(s, b, i);
        const __mmask16 seen = attn_tiles::softmax_block(
            s.s.data(), s.last.data() + 16 * b, s.m.data() + 16 * b, s.l16.data() + 256 * b, kt, n, alpha,
            [&](int r, __m512 p0, __m512 p1) {
              _mm512_storeu_ps(s.p.data() + 32 * r, p0);
              _mm512_storeu_ps(s.p.data() + 32 * r + 16, p1);
            });
        attn_tiles::seen_runs(seen, [&](auto r, int i) { pv_rows<D, decltype(r)::value>(s, b, i, n, alpha); });
      });
  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, rows, r, s.acc.data() + r * D, s.m[r],
               _mm512_reduce_add_ps(_mm512_loadu_ps(s.l16.data() + 16 * r)));
}

template <int D>
void run_format(const AttnArgs& a, const AttnItem& it) {
  switch (a.kv_format) {
    case KVFormat::kF32: return run<D, KVFormat::kF32>(a, it);
    case KVFormat::kBF16: return run<D, KVFormat::kBF16>(a, it);
    case KVFormat::kInt8: return run<D, KVFormat::kInt8>(a, it);
    case KVFormat::kFp8E4M3: return run<D, KVFormat::kFp8E4M3>(a, it);
    case KVFormat::kFp8E5M2: return run<D, KVFormat::kFp8E5M2>(a, it);
  }
}

}  // namespace

void attn_item_avx512_tiles(const AttnArgs& a, const AttnItem& it) {
  with_head_dim<64, 128>(a.d, [&](auto d) { run_format<decltype(d)::value>(a, it); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
