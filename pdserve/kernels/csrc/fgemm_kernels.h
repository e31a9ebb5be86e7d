// Float-weight GEMM kernels (weights stored as bf16 or f32), one entry per ISA level. No torch here: the ISA files
// include only this and common.h.
//
// Packed layout: W [N, K] is cut into panels of kPanel = 16 output columns (N padded with zero columns). A panel is
// contiguous and holds, for every step along K, the 16 columns side by side, so one 64-byte load gives one value
// per output lane:
//   f32  panel = [K][16] floats                       (64 bytes per k)
//   bf16 panel = [Kpad / 2][16][2] bf16, Kpad = K rounded up to kKBlock with zeros: entry [p][j] is the dword
//        (W[j][2p] in the low half, W[j][2p + 1] in the high half): vdpbf16ps's operand layout, and 16 consecutive
//        pairs (1 KiB) are exactly one AMX B tile (16 rows of 64 bytes).
// Lane j of an accumulator holds output column j of its panel, so every output is one fixed-order sum over K and
// the tile shape, row count and thread split cannot change its bits (packed_weight.h).
//
// Arithmetic per output y = x . w + bias (activations rounded to bf16 first for the bf16 format; a bf16 x bf16
// product is exact in fp32, so "+=" below is one fp32 rounding, the same whether done by FMA, vdpbf16ps or AMX):
//   f32, every level      acc += x[k] * w[k] for k = 0, 1, ..., K - 1 (fma on avx2/avx512, mul then add on generic)
//   bf16 "block" order    per K block b of 32 (16 pairs): E = sum_p x[2p] w[2p], O = sum_p x[2p+1] w[2p+1], each
//                         in pair order from 0, then acc = acc + (E + O). This is what one AMX tdpbf16ps with a
//                         64-byte K step computes (measured: see fgemm_amx.cpp), so AMX tiles and the FMA kernels
//                         of every level below agree bit for bit. Levels generic, avx2, avx512, amx.
//   bf16 "pair" order     per pair p: acc = (acc + x[2p+1] w[2p+1]) + x[2p] w[2p]: what vdpbf16ps computes (odd
//                         element first). Level avx512_bf16 (CPUs with AVX512-BF16 but no AMX, e.g. Zen 4/5).
// Results of the two bf16 orders differ in the last bits; within one level every path uses one order.
#pragma once

#include <cstdint>

#include "common.h"
#include "fused_kernels.h"

namespace pdserve::fgemm {

constexpr int kPanel = 16;   // output columns per panel: one zmm of fp32 lanes
constexpr int kKBlock = 32;  // bf16 K per block: one AMX tile K step (16 pairs, 64 bytes per row)

// y[r * ldy + c] for rows r < m and the columns of panels [p0, p1) (columns >= n are padding, never written).
struct Problem {
  const void* w;       // the packed panels
  int64_t kpad;        // K of the layout (bf16: multiple of kKBlock)
  int64_t n;           // real output columns
  const float* x;      // f32 format: activations [m][ldx]
  const uint16_t* xb;  // bf16 format: activations rounded to bf16 [m][ldx], zero past K up to kpad, or as tiles
  int64_t ldx;
  bool xb_tiles;       // xb holds AMX A tiles: tile (row block b, K block c) = rows 16b.. x K 32c.. at
                       // xb + (b * kpad / 32 + c) * 512, 16 rows of 32 bf16, rows past m zero
  int64_t m;
  float* y;
  int64_t ldy;
  const float* bias;   // may be null
  // A gated MLP's gate/up projection (amx level, prompt rows): panel p (a gate panel) is multiplied beside panel
  // p + up (its up panel), and y's 16 columns of panel p receive gated(gate, up) (bias null): the gated rows' kernel
  // over the same fp32 sums the two panels' y columns would hold, so the same bits as y then gated. AMX tiles
  // only (xb_tiles).
  GatedMulFn gated = nullptr;
  int64_t up = 0;
};

using PanelFn = void (*)(const Problem& pr, int64_t p0, int64_t p1);
// xb[r * kpad + i] = bf16(x[r * ldx + i]) for i < k, 0 for k <= i < kpad, rows [r0, r1). bf16(v): round to nearest
// even, |v| < FLT_MIN (fp32 subnormals) to a zero of v's sign (AMX and vdpbf16ps treat bf16 subnormals as zero).
using ToBf16Fn = void (*)(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t kpad,
                          uint16_t* xb);

struct Kernels {
  PanelFn f32;
  PanelFn bf16;
  ToBf16Fn to_bf16;
  const char* bf16_order;  // "block" or "pair" (see above)
  bool tiles;              // the bf16 kernel takes xb as AMX tiles from amx_min_rows() rows on
};

inline uint16_t to_bf16_flush(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);  // zero or subnormal
  return fp32_to_bf16(v);
}

extern const Kernels kGeneric;
#if defined(__x86_64__)
extern const Kernels kAvx2;
extern const Kernels kAvx512;
extern const Kernels kAvx512Bf16;
extern const Kernels kAmx;
// The block-order bf16 kernel of avx512 (the amx level runs it below its row threshold).
void bf16_block_avx512(const Problem& pr, int64_t p0, int64_t p1);
void to_bf16_avx512(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t kpad, uint16_t* xb);
void f32_avx512(const Problem& pr, int64_t p0, int64_t p1);
#endif

// x [m][ldx] rounded to bf16 (kn.to_bf16) into out: row-major [rows][kpad] or, with tiles, AMX A tiles (the
// Problem::xb_tiles layout); rows padded to a multiple of 16 with zeros. Blocks of 16 rows split over the threads.
void bf16_activations(const Kernels& kn, const float* x, int64_t ldx, int64_t m, int64_t k, int64_t kpad, bool tiles,
                      uint16_t* out);

// Cache blocking of a many-row call on AMX tiles: the kernel takes panel pair by panel pair, each over all of the
// call's rows, so a call's bf16 activations are read once per pair (512 rows x K = 2048: 2 MiB, past a core's L2,
// streamed from L3 per pair). run_blocked runs panels [p0, p1) in groups whose weights stay in L2 (panel_group), each
// group over chunks of rows whose activations do (row_chunk): a chunk is read from L3 once per group, a group's
// weights from memory once. Every output is still one kernel's sum over all of K, so the bits do not change.
int64_t row_chunk(int64_t kpad);
int64_t panel_group(int64_t kpad);  // even: the AMX kernel's 32-column pairs
// fn over rows in chunks; pr is a bf16 problem (the chunks offset xb and y).
void run_row_chunks(PanelFn fn, const Problem& pr, int64_t p0, int64_t p1);
void run_blocked(PanelFn fn, const Problem& pr, int64_t p0, int64_t p1);

// Rows from which the amx level multiplies with AMX tiles (below: the avx512 block-order kernel; same bits). AMX
// is as fast as the FMA kernel at one row and faster from two (BENCHMARKS.md), so 1 unless changed (tests).
int64_t amx_min_rows();
void set_amx_min_rows(int64_t rows);

}  // namespace pdserve::fgemm
