// AMX paged attention for bf16 caches, head_dim 64 and 128 (attention_bf16.h has the scheme). Per key tile of 32
// and row block of 16: S = Q . K^T as two 16 x 16 C tiles (keys 0-15, 16-31), 2 d / 32 tile products each (q in
// two bf16 parts); then
// per dim panel of 16: P . V as one tile product (K step = the 32 keys), added to acc * alpha per row.
// Tiles: tmm0, 1 scores; tmm2 Q; tmm3, 4 K^T halves; tmm5 P . V panel; tmm6 P; tmm7 V panel. All 16 x 64 bytes.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

#include "attention_bf16.h"

namespace pdserve {
namespace {

using attn_bf16::kTile;
using attn_bf16::Scratch;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Scores of row block b against the key tile into s.s [16][32].
// The query goes in as two bf16 parts (q = hi + lo, ~16 significant bits: s.q and s.qlo), so a score carries the
// rounding of bf16 K only (exact: the cache is bf16), not of q's: two more tile products per step, cheap beside the
// softmax's vector work.
template <int D>
void scores(Scratch& s, int64_t b) {
  _tile_zero(0);
  _tile_zero(1);
  for (int st = 0; st < D / 32; ++st) {
    const int64_t at = (b * (D / 32) + st) * 512;
    _tile_loadd(2, s.q.data() + at, 64);
    _tile_loadd(3, s.kt.data() + (st * 2) * 256, 64);
    _tile_loadd(4, s.kt.data() + (st * 2 + 1) * 256, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
    _tile_loadd(2, s.qlo.data() + at, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, s.s.data(), 128);
  _tile_stored(1, s.s.data() + 16, 128);
}

// acc rows of block b += P . V, one 16-dim panel (one tile product) at a time: acc = acc * alpha + panel.
template <int D>
void pv(Scratch& s, int64_t b, __mmask16 seen, const float* alpha) {
  alignas(64) float out[16 * 16];
  _tile_loadd(6, s.p.data(), 64);
  for (int c = 0; c < D / 16; ++c) {
    _tile_zero(5);
    _tile_loadd(7, s.vt.data() + c * 256, 64);
    _tile_dpbf16ps(5, 6, 7);
    _tile_stored(5, out, 64);
    for (int i = 0; i < 16; ++i) {
      if (!(seen >> i & 1)) continue;
      float* acc = s.acc.data() + (16 * b + i) * D + 16 * c;
      _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(alpha[i]),
                                            _mm512_load_ps(out + 16 * i)));
    }
  }
}

template <int D>
void run(const AttnArgs& a, const AttnItem& it) {
  thread_local Scratch s;
  attn_bf16::prepare<D, true>(a, it, s);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  attn_bf16::walk<D>(a, it, s, [&](int64_t b) { scores<D>(s, b); },
                     [&](int64_t b, __mmask16 seen, const float* alpha) { pv<D>(s, b, seen, alpha); });
  _tile_release();
  attn_bf16::finish<D>(a, it, s);
}

}  // namespace

void attn_item_amx(const AttnArgs& a, const AttnItem& it) {
  if (a.d == 64) {
    run<64>(a, it);
  } else {
    run<128>(a, it);
  }
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
