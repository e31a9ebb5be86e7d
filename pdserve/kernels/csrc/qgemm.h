// Native GEMMs over GGUF block weights (Q4_0 ... Q6_K, IQ4_*): the packed layout, the activation and decode
// buffers and the per-ISA kernel table. No torch here: the ISA files include only this header, common.h and
// qgemm_decode.h.
//
// Packed layout. Output columns go in panels of 16; a panel holds, for each GGUF block along K (32 or 256 values,
// a "chunk"), the 16 columns' blocks interleaved: first the chunk's scales, 16 columns wide (fp16 d/dmin/m, 8-bit
// sub-block scales, converted to fp32 on the fly), then its values (so a chunk is read front to back). A "weight
// vector" is 64 bytes: 4 consecutive K values of each of the 16 columns (byte 4c + t = column c, K value 4z + t).
// That is the operand of vpdpbusd with lane = column, and one row of an AMX B tile. A chunk of QB values has
// Z = QB/4 weight vectors, stored as bit sections of 64-byte units (byte b of a unit belongs to byte b of the
// weight vectors it feeds):
//   nib  Z/2 units: low nibble -> vector i, high nibble -> vector i + Z/2            (bits 0..3 of the value)
//   p2   Z/4 units: bits 2j..2j+1 -> vector 4u + j, placed at value bit `p2`          (Q6_K 4..5, Q2_K/Q3_K 0..1)
//   p1   Z/8 units: bit j -> vector 8u + j, placed at value bit `p1`                  (Q5_* 4, Q3_K 2)
//   raw  Z units: the value bytes                                                     (Q8_0: q ^ 0x80)
// Decoded, every value is an unsigned byte u = q + off (IQ4 types: their table value + 128) with a fp32 scale dw
// (and min mw) per sub-block of S = 16 or 32 values:  w = dw * (u - off) (+ mw).
//
// Arithmetic (batch invariance, see packed_weight.h). Activations are quantized per 32 values to int8 (dx =
// amax/127, round half to even). For each (row, column, sub-block) every path computes the same exact int32
// isum = sum (u - off) * xq; then, over the sub-blocks in K order, acc = fma(float(isum), dw * dx, acc) and for
// types with a min acc = fma(mw, xs, acc) with xs = dx * float(sum of the sub-block's xq). y = acc (+ bias).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace pdserve::qgemm {

constexpr int kPanel = 16;  // output columns per panel (one zmm of int32/fp32 lanes)
constexpr int kVec = 64;    // bytes per weight vector

// How a chunk's scales are stored (16 columns wide, in this order) and turned into dw/mw per sub-block.
enum class ScaleKind : int {
  kD,   // d f16                                   dw = d
  kDM,  // d f16, m f16                            dw = d, mw = m
  kK4,  // d, dmin f16, sc u8[8], m u8[8]          dw = d*sc, mw = -(dmin*m)          (Q4_K, Q5_K)
  kS8,  // d f16, sc s8[QB/S]                      dw = d*sc                          (Q6_K, Q3_K, IQ4_XS)
  kQ2,  // d, dmin f16, scm u8[16] (sc | m << 4)   dw = d*sc, mw = -(dmin*m)          (Q2_K)
};

struct QType {
  int id;             // ggml type id
  const char* name;
  int qb;             // values per GGUF block (a chunk)
  int gguf_bytes;     // bytes per GGUF block
  int s;              // values per sub-block (own scale): 16 or 32
  int off;            // u - off is the signed quant value (128: signed 8-bit and table types)
  bool min;           // has a min term mw
  bool nib;           // value sections present (see the layout)
  int p2, p1;         // value bit of the 2-bit / 1-bit planes, -1 if none
  bool raw, lut;      // raw bytes (Q8_0); nibble is an index into the IQ4 table
  ScaleKind sk;
  // Derived: byte offsets of the value sections from the chunk's values (which follow its scales), and the size
  // of a chunk (16 columns).
  int z() const { return qb / 4; }
  int nsub() const { return qb / s; }
  int off_p2() const { return nib ? z() / 2 * kVec : 0; }
  int off_p1() const { return off_p2() + (p2 >= 0 ? z() / 4 * kVec : 0); }
  int off_raw() const { return off_p1() + (p1 >= 0 ? z() / 8 * kVec : 0); }
  int value_bytes() const { return off_raw() + (raw ? z() * kVec : 0); }
  int scale_bytes() const {
    switch (sk) {
      case ScaleKind::kD: return 32;
      case ScaleKind::kDM: return 64;
      case ScaleKind::kK4: return 64 + 2 * 8 * kPanel;
      case ScaleKind::kS8: return 32 + nsub() * kPanel;
      case ScaleKind::kQ2: return 64 + 16 * kPanel;
    }
    return 0;
  }
  int chunk_bytes() const { return scale_bytes() + value_bytes(); }
};

// The supported type with this ggml id, or null.
const QType* find_type(int id);
// Every supported type (for listings and error messages), ended by a null name.
const QType* all_types();

// The IQ4_NL/IQ4_XS table, + 128 (unsigned bytes).
constexpr uint8_t kIq4Table[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// Quantized activation rows (the caller's buffer), in tiles of T = 16 rows so a kernel addresses a tile's rows at
// constant offsets and an AMX A tile (16 rows x S bytes) is contiguous: q int8 [m/T][k/s][T][s]; dx (per 32
// values) [m/T][k/32][T]; per sub-block init = -off * sum(q) and (min types) xs = dx * float(sum(q)),
// [m/T][k/s][T] each. m is a multiple of T (rows past the caller's are padding). Fewer than 16 rows take T = the
// power of two from m: one row (a batch-1 decode) then lies together (k + 3 x k/32 x 4 bytes for sub-blocks of 32)
// instead of one cache line per sub-block and array, so a GEMV's activations stay in L1 beside the weights it
// streams.
struct Act {
  int8_t* q;
  float* dx;
  int32_t* init;
  float* xs;
  int64_t k, nb32, nsub, s;
  int lt = 4;  // log2 T
  int64_t tile_rows() const { return int64_t{1} << lt; }
  // Element (row r, entry i of n per row) of a [m/T][n][T] array.
  int64_t at(int64_t r, int64_t n, int64_t i) const { return (((r >> lt) * n + i) << lt) + (r & (tile_rows() - 1)); }
  int64_t qi(int64_t r, int64_t sub) const { return at(r, nsub, sub) * s; }
  int64_t di(int64_t r, int64_t b) const { return at(r, nb32, b); }
  int64_t si(int64_t r, int64_t sub) const { return at(r, nsub, sub); }
};

// Bytes of an Act buffer of m rows (rounded up to its tile rows; each array 64-byte aligned) and its views into
// `buf`.
size_t act_bytes(const QType& t, int64_t m, int64_t k);
Act act_view(const QType& t, int64_t m, int64_t k, uint8_t* buf);
// Zero rows r0..r1 (up to the end of their tile) of every array of a: padding rows of an AMX tile are finite,
// never denormal.
void zero_rows(const Act& a, int64_t r0, int64_t r1);
// Store one quantized 32-block b of row r: q[32], its scale d and the sums of its sub-blocks (1 or 2).
inline void put_block(const QType& t, const Act& a, int64_t r, int64_t b, const int8_t* q, float d,
                      const int32_t* sums) {
  const int per = QK / t.s;
  a.dx[a.di(r, b)] = d;
  for (int h = 0; h < per; ++h) {
    const int64_t sub = b * per + h, i = a.si(r, sub);
    std::memcpy(a.q + a.qi(r, sub), q + h * t.s, static_cast<size_t>(t.s));
    a.init[i] = -t.off * sums[h];
    if (t.min) a.xs[i] = d * static_cast<float>(sums[h]);
  }
}

// Decoded weights of a run of consecutive chunks of one panel: wq [n*Z][64] u8, dw/mw [n*QB/S][16] fp32.
struct Dec {
  uint8_t* wq;
  float* dw;
  float* mw;
};
size_t dec_bytes(const QType& t, int64_t nchunks);
Dec dec_view(const QType& t, int64_t nchunks, uint8_t* buf);

struct Ops {
  // Quantize activation rows r0..r1 of x (row r at x + r*ldx) into a.
  void (*quantize_act)(const QType& t, const float* x, int64_t ldx, int64_t r0, int64_t r1, const Act& a);
  // Decode n chunks of a panel (packed points at the first) into d.
  void (*decode)(const QType& t, const uint8_t* packed, int64_t n, const Dec& d);
  // acc[r*16 + c] (r < mr <= max_rows, in/out) over nsubs sub-blocks of d, whose first is global sub-block s0,
  // against activation rows r0..r0+mr.
  void (*tile)(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr,
               float* acc);
  int max_rows;
  // As tile over n whole chunks of a panel read straight from the packed bytes (packed points at the first; the
  // first sub-block is the panel's first), decoding in registers. Returns false, acc untouched, for a type or row
  // count it leaves to decode + tile; null where the level has none.
  bool (*gemv)(const QType& t, const uint8_t* packed, int64_t n, const Act& a, int64_t r0, int64_t mr, float* acc);
  // Rows up to which a linear multiplies each panel row tile by row tile with gemv (its weight vectors decoded in
  // registers again for every tile) instead of decoding the panel once into L2 for all the tiles: the decode pass
  // reads the weights from memory with nothing to compute beside it, the register path overlaps the two, and pays
  // while re-decoding costs less (measured per level and type). Null: max_rows.
  int64_t (*few_rows)(const QType& t);
  // The amx level's: decode for tile16 (values u - off as signed bytes; it also configures the calling thread's
  // AMX tiles), tile with mr = 16 on AMX tiles (16 activation rows from r0: the Act buffer is padded to whole
  // tiles), and end16 to release the tiles after the last tile16. Null below amx.
  void (*decode16)(const QType& t, const uint8_t* packed, int64_t n, const Dec& d);
  void (*tile16)(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, float* acc);
  void (*end16)();
  // The amx level's prompt-row path (QgemmWeight::forward_rows): n chunks of a panel decoded (d: scratch) and
  // written to out as bf16(dw * (u - off) (+ mw)), the fp32 value of dequant_decoded rounded to nearest even
  // (fp32 subnormals to a signed zero), in the bf16 panel layout of fgemm_kernels.h ([n * QB / 2][16][2]).
  // Null below amx.
  void (*decode_bf16)(const QType& t, const uint8_t* packed, int64_t n, const Dec& d, uint16_t* out);
  // As tile over two decoded panels at once (acc0, acc1: their accumulators), each activation broadcast feeding
  // both; mr <= max_rows2. Each output's operations are tile's: the same bits. Null where the level has none.
  void (*tile2)(const QType& t, const Dec& d0, const Dec& d1, int64_t nsubs, const Act& a, int64_t s0, int64_t r0,
                int64_t mr, float* acc0, float* acc1);
  int max_rows2;
};

extern const Ops kGenericOps;
#if defined(__x86_64__)
extern const Ops kAvx2Ops;
extern const Ops kAvx512Ops;
extern const Ops kAmxOps;
namespace avx512 {  // the AVX-512 entries the amx level reuses
void quantize_act(const QType& t, const float* x, int64_t ldx, int64_t r0, int64_t r1, const Act& a);
void decode(const QType& t, const uint8_t* packed, int64_t n, const Dec& d);
void tile(const QType& t, const Dec& d, int64_t nsubs, const Act& a, int64_t s0, int64_t r0, int64_t mr, float* acc);
bool gemv(const QType& t, const uint8_t* packed, int64_t n, const Act& a, int64_t r0, int64_t mr, float* acc);
int64_t few_rows(const QType& t);
}  // namespace avx512
#endif

// Dequantized columns c0 <= c < c1 of n decoded chunks: out[(c - c0) * ldo + kk] = dw * (u - off) (+ mw),
// bitwise equal to gguf.quants.dequantize (qgemm_generic.cpp).
void dequant_decoded(const QType& t, const Dec& d, int64_t n, int c0, int c1, float* out, int64_t ldo);

// Repack panels [p0, p1) (columns 16p .. 16p+15) of GGUF data [n, k/qb*gguf_bytes] into out (the whole packed
// weight: panel p at p * (k/qb) * chunk_bytes). Columns past n are zero (their outputs are never written).
void pack_panels(const QType& t, const uint8_t* data, int64_t n, int64_t k, int64_t p0, int64_t p1, uint8_t* out);

}  // namespace pdserve::qgemm
