// Portable scalar paged attention: one key at a time, online softmax per query row. Any head_dim.
#include <cmath>
#include <limits>
#include <vector>

#include "attention_kernels.h"

namespace pdserve {

namespace {

// Key or value row `key` of the item's KV head, as f32 (converted into tmp unless the cache is f32).
const float* kv_row(const AttnArgs& a, const AttnItem& it, int plane, int64_t key, float* tmp) {
  const int64_t blk = a.block_table[it.seq * a.bt_stride + key / a.block_size];
  const int64_t slot = (plane * a.num_blocks + blk) * a.block_size + key % a.block_size;
  if (kv_quantized(a.kv_format)) {
    const int64_t row = kv_row_bytes(a.kv_format, a.d);
    kv_dequantize_row(a.kv_format, static_cast<const uint8_t*>(a.kv) + (slot * a.hkv + it.kvh) * row, a.d, tmp);
    return tmp;
  }
  const int64_t off = slot * a.hkv * a.d + it.kvh * a.d;
  if (!a.kv_bf16) return static_cast<const float*>(a.kv) + off;
  const uint16_t* src = static_cast<const uint16_t*>(a.kv) + off;
  for (int64_t i = 0; i < a.d; ++i) tmp[i] = bf16_to_fp32(src[i]);
  return tmp;
}

}  // namespace

void attn_item_generic(const AttnArgs& a, const AttnItem& it) {
  const int64_t g = a.hq / a.hkv, d = a.d, per_head = (it.t1 - it.t0) * g, rows = per_head * it.nkvh;
  std::vector<float> acc(rows * d, 0.f), m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.f);
  std::vector<float> ktmp(d), vtmp(d);
  for (int64_t key = it.k0; key < it.k1; ++key) {
    for (int64_t hl = 0; hl < it.nkvh; ++hl) {  // every head of the item on this key
      AttnItem head = it;
      head.kvh = it.kvh + static_cast<int32_t>(hl);
      const float* k = kv_row(a, head, 0, key, ktmp.data());
      const float* v = kv_row(a, head, 1, key, vtmp.data());
      // rows of tokens before t_first do not see this key (causal)
      const int64_t t_first = std::max<int64_t>(0, key - it.pos0);
      for (int64_t r = hl * per_head + t_first * g; r < (hl + 1) * per_head; ++r) {
        const float* q = a.q + item_row_offset(it, r, g, d, a.q_stride);
        float s = 0.f;
        for (int64_t i = 0; i < d; ++i) s += q[i] * k[i];
        s *= a.scale;
        if (a.softcap > 0.f) softcap_scores(&s, 1, a.softcap);
        const float mn = std::max(m[r], s), alpha = std::exp(m[r] - mn), p = std::exp(s - mn);
        float* o = acc.data() + r * d;
        for (int64_t i = 0; i < d; ++i) o[i] = o[i] * alpha + p * v[i];
        l[r] = l[r] * alpha + p;
        m[r] = mn;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) finish_row(a, it, rows, r, acc.data() + r * d, m[r], l[r]);
}

}  // namespace pdserve
