// The quantized-cache side of the vector attention kernels' locate_tile: a key tile's K/V rows (kv_quant.h)
// dequantized once into L1 buffers, shared by every query row of the work item, so memory carries the codes only.
// Include after the ISA file's `#pragma GCC target(...)`; Dequant is that file's row dequantizer.
#pragma once

#include "attention_kernels.h"

namespace pdserve {

using DequantRowFn = void (*)(KVFormat f, const uint8_t* src, float* dst);

// Keys kt .. kt + n - 1 into kbuf/vbuf ([16][D] each); entries n..15 repeat key kt (their scores are masked).
template <int D, DequantRowFn Dequant>
void locate_tile_quantized(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, const float** kp,
                           const float** vp, float* kbuf, float* vbuf) {
  const int32_t* bt = a.block_table + it.seq * a.bt_stride;
  const int64_t rb = kv_row_bytes(a.kv_format, D), plane = a.num_blocks * a.block_size * a.hkv * rb;
  const uint8_t* base = static_cast<const uint8_t*>(a.kv);
  int64_t bi = kt / a.block_size, off = kt % a.block_size;
  for (int i = 0; i < n; ++i) {
    const uint8_t* src = base + ((bt[bi] * a.block_size + off) * a.hkv + it.kvh) * rb;
    if (++off == a.block_size) off = 0, ++bi;
    Dequant(a.kv_format, src, kbuf + i * D);
    Dequant(a.kv_format, src + plane, vbuf + i * D);
    kp[i] = kbuf + i * D;
    vp[i] = vbuf + i * D;
  }
  for (int i = n; i < 16; ++i) kp[i] = kp[0], vp[i] = vp[0];
}

}  // namespace pdserve
