// AVX512-BF16 paged attention for bf16 caches (and int8/fp8 ones, converted per key tile), head_dim 64 and 128
// (attention_bf16.h has the scheme): the AMX kernel's tiles multiplied with vdpbf16ps, up to four rows at a time
// sharing each K and V load (with one row a load, the loads bound the kernel; BENCHMARKS.md). Scores: 16 keys per
// zmm lane-wise, a query pair broadcast per d-pair; P . V: 16 dims per zmm, acc * alpha first, then a probability
// pair broadcast per key pair.
// A row's chains and their order do not depend on how many rows share the loads: the same bits.
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

// Scores of rows i .. i + R - 1 of row block b against the key tile into sc[32] each (R rows share each K load).
// Four accumulation chains a row (even and odd d-pairs of each key half), in the same order whatever R: a row's
// bits do not depend on the rows beside it.
template <int D, int R>
void scores(const Scratch& s, int64_t b, int i, float* sc) {
  __m512 s0[R], s1[R], t0[R], t1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = t0[r] = t1[r] = _mm512_setzero_ps();
  for (int st = 0; st < D / 32; ++st) {
    const uint16_t* q = s.q.data() + ((b * (D / 32) + st) * 16 + i) * 32;
    const uint32_t* k0 = s.kt.data() + (st * 2) * 256;
    const uint32_t* k1 = k0 + 256;
    for (int j = 0; j < 16; j += 2) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(k0 + 16 * j), kb = (__m512bh)_mm512_loadu_si512(k1 + 16 * j);
      const __m512bh kc = (__m512bh)_mm512_loadu_si512(k0 + 16 * j + 16);
      const __m512bh kd = (__m512bh)_mm512_loadu_si512(k1 + 16 * j + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = bcast_pair(q + 32 * r + 2 * j), qn = bcast_pair(q + 32 * r + 2 * j + 2);
        s0[r] = _mm512_dpbf16_ps(s0[r], qp, ka);
        s1[r] = _mm512_dpbf16_ps(s1[r], qp, kb);
        t0[r] = _mm512_dpbf16_ps(t0[r], qn, kc);
        t1[r] = _mm512_dpbf16_ps(t1[r], qn, kd);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(sc + 32 * r, _mm512_add_ps(s0[r], t0[r]));
    _mm512_storeu_ps(sc + 32 * r + 16, _mm512_add_ps(s1[r], t1[r]));
  }
}

// acc rows i .. i + R - 1 of block b (each seeing the tile): acc * alpha first, then a probability pair per key
// pair; R rows share each V load, every row's chains and order as with R = 1.
template <int D, int R>
void pv_rows(Scratch& s, int64_t b, int i, const float* alpha) {
  for (int c = 0; c < D / 16; ++c) {  // two chains per dim panel, as in scores
    const uint32_t* v = s.vt.data() + c * 256;
    __m512 o[R], e[R];
    for (int r = 0; r < R; ++r) {
      const float* acc = s.acc.data() + ((16 * b + i + r) * D + 16 * c);
      o[r] = _mm512_mul_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(alpha[i + r]));
      e[r] = _mm512_setzero_ps();
    }
    for (int j = 0; j < kTile / 2; j += 2) {
      const __m512bh va = (__m512bh)_mm512_loadu_si512(v + 16 * j);
      const __m512bh vb = (__m512bh)_mm512_loadu_si512(v + 16 * j + 16);
      for (int r = 0; r < R; ++r) {
        const uint16_t* pb = s.p.data() + 32 * (i + r);
        o[r] = _mm512_dpbf16_ps(o[r], bcast_pair(pb + 2 * j), va);
        e[r] = _mm512_dpbf16_ps(e[r], bcast_pair(pb + 2 * j + 2), vb);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(s.acc.data() + ((16 * b + i + r) * D + 16 * c), _mm512_add_ps(o[r], e[r]));
  }
}

template <int D>
void pv(Scratch& s, int64_t b, __mmask16 seen, const float* alpha) {
  for (int i = 0; i < 16;) {
    if (!(seen >> i & 1)) {
      ++i;
      continue;
    }
    int run = 1;  // seen rows from i on, up to 4: taken 4, 2 or 1 at a time
    while (run < 4 && i + run < 16 && (seen >> (i + run) & 1)) ++run;
    if (run == 4) {
      pv_rows<D, 4>(s, b, i, alpha);
    } else if (run >= 2) {
      pv_rows<D, 2>(s, b, i, alpha);
      run = 2;
    } else {
      pv_rows<D, 1>(s, b, i, alpha);
    }
    i += run;
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
        int i = 0;
        for (; i + 3 < 16 && 16 * b + i + 3 < rows; i += 4) scores<D, 4>(s, b, i, s.s.data() + 32 * i);
        for (; i + 1 < 16 && 16 * b + i + 1 < rows; i += 2) scores<D, 2>(s, b, i, s.s.data() + 32 * i);
        if (i < 16 && 16 * b + i < rows) scores<D, 1>(s, b, i, s.s.data() + 32 * i);
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
