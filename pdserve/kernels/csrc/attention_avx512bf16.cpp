// AVX512-BF16 paged attention for bf16 caches, head_dim 64 and 128 (attention_bf16.h has the scheme): the AMX
// kernel's tiles multiplied with vdpbf16ps, one row at a time. Scores: 16 keys per zmm lane-wise, a query pair
// broadcast per d-pair; P . V: 16 dims per zmm, acc * alpha first, then a probability pair broadcast per key pair.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

#include "attention_bf16.h"

namespace pdserve {
namespace {

using attn_bf16::bcast_pair;
using attn_bf16::kTile;
using attn_bf16::Scratch;

// Scores of row r (row block b, index i in it) against the key tile into sc[32].
// Four accumulation chains (even and odd d-pairs of each key half): a decode block has G rows, too few to hide
// vdpbf16ps's latency with one chain per half.
template <int D>
void scores(const Scratch& s, int64_t b, int i, float* sc) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
  for (int st = 0; st < D / 32; ++st) {
    const uint16_t* q = s.q.data() + ((b * (D / 32) + st) * 16 + i) * 32;
    const uint32_t* k0 = s.kt.data() + (st * 2) * 256;
    const uint32_t* k1 = k0 + 256;
    for (int j = 0; j < 16; j += 2) {
      const __m512bh qp = bcast_pair(q + 2 * j), qn = bcast_pair(q + 2 * j + 2);
      s0 = _mm512_dpbf16_ps(s0, qp, (__m512bh)_mm512_loadu_si512(k0 + 16 * j));
      s1 = _mm512_dpbf16_ps(s1, qp, (__m512bh)_mm512_loadu_si512(k1 + 16 * j));
      t0 = _mm512_dpbf16_ps(t0, qn, (__m512bh)_mm512_loadu_si512(k0 + 16 * j + 16));
      t1 = _mm512_dpbf16_ps(t1, qn, (__m512bh)_mm512_loadu_si512(k1 + 16 * j + 16));
    }
  }
  _mm512_storeu_ps(sc, _mm512_add_ps(s0, t0));
  _mm512_storeu_ps(sc + 16, _mm512_add_ps(s1, t1));
}

// acc rows of block b: acc * alpha first, then a probability pair per key pair.
template <int D>
void pv(Scratch& s, int64_t b, __mmask16 seen, const float* alpha) {
  for (int i = 0; i < 16; ++i) {
    if (!(seen >> i & 1)) continue;
    const __m512 al = _mm512_set1_ps(alpha[i]);
    const uint16_t* pb = s.p.data() + 32 * i;
    for (int c = 0; c < D / 16; ++c) {  // two chains per dim panel, as in scores
      float* acc = s.acc.data() + ((16 * b + i) * D + 16 * c);
      __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc), al), e = _mm512_setzero_ps();
      const uint32_t* v = s.vt.data() + c * 256;
      for (int j = 0; j < kTile / 2; j += 2) {
        o = _mm512_dpbf16_ps(o, bcast_pair(pb + 2 * j), (__m512bh)_mm512_loadu_si512(v + 16 * j));
        e = _mm512_dpbf16_ps(e, bcast_pair(pb + 2 * j + 2), (__m512bh)_mm512_loadu_si512(v + 16 * j + 16));
      }
      _mm512_storeu_ps(acc, _mm512_add_ps(o, e));
    }
  }
}

template <int D>
void run(const AttnArgs& a, const AttnItem& it) {
  thread_local Scratch s;
  attn_bf16::prepare<D>(a, it, s);
  const int64_t rows = attn_bf16::item_rows(a, it);
  attn_bf16::walk<D>(
      a, it, s,
      [&](int64_t b) {
        for (int i = 0; i < 16 && 16 * b + i < rows; ++i) scores<D>(s, b, i, s.s.data() + 32 * i);
      },
      [&](int64_t b, __mmask16 seen, const float* alpha) { pv<D>(s, b, seen, alpha); });
  attn_bf16::finish<D>(a, it, s);
}

}  // namespace

void attn_item_avx512bf16(const AttnArgs& a, const AttnItem& it) {
  if (a.d == 64) {
    run<64>(a, it);
  } else {
    run<128>(a, it);
  }
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
