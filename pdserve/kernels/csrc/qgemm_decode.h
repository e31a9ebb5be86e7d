// The qgemm chunk decoder (packed sections -> weight vectors, scales -> dw/mw), written once over a vector policy P
// that each ISA file supplies (64-byte units as one zmm, two ymm or eight uint64 words; 16 floats likewise).
// Include it after the file's `#pragma GCC target` so the instantiations take that target; P lives in the file's
// anonymous namespace, so each file's instantiations are its own.
//
// P provides: V load(const uint8_t*), void store(uint8_t*, V), V zero(), V and8(V, uint8_t) (byte mask),
// V or_(V, V), V srl(V, int) and V sll(V, int) (any lane width of 16+ bits: callers mask each byte), V lut(V)
// (bytes < 16 -> kIq4Table); F half(const uint8_t*) (16 fp16), F u8(const uint8_t*), F s8(...), F lo4(...) and
// F hi4(...) (16 bytes), F mul(F, F), F neg(F), void store(float*, F).
#pragma once

#include <cstdint>

#include "qgemm.h"

namespace pdserve::qgemm {

// Bits [from, from+width) of each byte of u moved to bit `to` (others zero).
template <class P>
inline typename P::V place(typename P::V u, int from, int to, uint8_t width_mask) {
  const uint8_t mask = static_cast<uint8_t>(width_mask << to);
  return P::and8(from >= to ? P::srl(u, from - to) : P::sll(u, to - from), mask);
}

// A packed format as compile-time parameters (QType's fields), for the register GEMVs' template arguments.
struct Fmt {
  int qb;
  bool nib;
  int p2, p1;  // value bit of the 2-bit / 1-bit plane, -1 if none
  bool raw, lut;
  int s;
  bool min;
};

// Weight vector z of a packed chunk (ch: its values), built in a register: what decode_values stores for it.
template <class P, Fmt f>
__attribute__((always_inline)) inline typename P::V weight_vector(const uint8_t* ch, int64_t z) {
  constexpr int Z = f.qb / 4, Z2 = Z / 2;
  constexpr int offp2 = f.nib ? Z2 * kVec : 0, offp1 = offp2 + (f.p2 >= 0 ? Z / 4 * kVec : 0);
  if constexpr (f.raw) return P::load(ch + z * kVec);
  typename P::V v = P::zero();
  if constexpr (f.nib)
    v = z < Z2 ? P::and8(P::load(ch + z * kVec), 0x0F) : P::and8(P::srl(P::load(ch + (z - Z2) * kVec), 4), 0x0F);
  if constexpr (f.p2 >= 0) v = P::or_(v, place<P>(P::load(ch + offp2 + (z / 4) * kVec), 2 * (z % 4), f.p2, 3));
  if constexpr (f.p1 >= 0) v = P::or_(v, place<P>(P::load(ch + offp1 + (z / 8) * kVec), z % 8, f.p1, 1));
  if constexpr (f.lut) v = P::lut(v);
  return v;
}

// fn(FmtTag<f>{}) for the packed format f of ggml type `id` (fn's result), or R{} for a type without one: the one
// table of the register GEMVs' formats.
template <Fmt f>
struct FmtTag {
  static constexpr Fmt value = f;
};
template <class R, class Fn>
R with_fmt(int id, Fn fn) {
  switch (id) {  //                     qb   nib    p2  p1  raw    lut    s   min
    case 2: return fn(FmtTag<Fmt{32, true, -1, -1, false, false, 32, false}>{});    // Q4_0
    case 3: return fn(FmtTag<Fmt{32, true, -1, -1, false, false, 32, true}>{});     // Q4_1
    case 6: return fn(FmtTag<Fmt{32, true, -1, 4, false, false, 32, false}>{});     // Q5_0
    case 7: return fn(FmtTag<Fmt{32, true, -1, 4, false, false, 32, true}>{});      // Q5_1
    case 8: return fn(FmtTag<Fmt{32, false, -1, -1, true, false, 32, false}>{});    // Q8_0
    case 10: return fn(FmtTag<Fmt{256, false, 0, -1, false, false, 16, true}>{});   // Q2_K
    case 11: return fn(FmtTag<Fmt{256, false, 0, 2, false, false, 16, false}>{});   // Q3_K
    case 12: return fn(FmtTag<Fmt{256, true, -1, -1, false, false, 32, true}>{});   // Q4_K
    case 13: return fn(FmtTag<Fmt{256, true, -1, 4, false, false, 32, true}>{});    // Q5_K
    case 14: return fn(FmtTag<Fmt{256, true, 4, -1, false, false, 16, false}>{});   // Q6_K
    case 20: return fn(FmtTag<Fmt{32, true, -1, -1, false, true, 32, false}>{});    // IQ4_NL
    case 23: return fn(FmtTag<Fmt{256, true, -1, -1, false, true, 32, false}>{});   // IQ4_XS
    default: return R{};
  }
}

// The weight vectors of one chunk (ch: its values). Loops run plane position outermost so the shift counts are loop-invariant.
template <class P, int QB, bool NIB, int P2, int P1, bool RAW, bool LUT>
__attribute__((always_inline)) inline void decode_values(const uint8_t* ch, uint8_t* wq) {
  using V = typename P::V;
  constexpr int Z = QB / 4, Z2 = Z / 2;
  if constexpr (RAW) {
    for (int z = 0; z < Z; ++z) P::store(wq + z * kVec, P::load(ch + z * kVec));
    return;
  } else {
    constexpr int offp2 = NIB ? Z2 * kVec : 0, offp1 = offp2 + (P2 >= 0 ? Z / 4 * kVec : 0);
    if constexpr (NIB) {
      for (int i = 0; i < Z2; ++i) {
        const V u = P::load(ch + i * kVec);
        P::store(wq + i * kVec, P::and8(u, 0x0F));
        P::store(wq + (i + Z2) * kVec, P::and8(P::srl(u, 4), 0x0F));
      }
    } else {
      for (int z = 0; z < Z; ++z) P::store(wq + z * kVec, P::zero());
    }
    if constexpr (P2 >= 0) {
      for (int j = 0; j < 4; ++j)
        for (int u = 0; u < Z / 4; ++u) {
          uint8_t* o = wq + (4 * u + j) * kVec;
          P::store(o, P::or_(P::load(o), place<P>(P::load(ch + offp2 + u * kVec), 2 * j, P2, 3)));
        }
    }
    if constexpr (P1 >= 0) {
      for (int j = 0; j < 8; ++j)
        for (int u = 0; u < Z / 8; ++u) {
          uint8_t* o = wq + (8 * u + j) * kVec;
          P::store(o, P::or_(P::load(o), place<P>(P::load(ch + offp1 + u * kVec), j, P1, 1)));
        }
    }
    if constexpr (LUT)
      for (int z = 0; z < Z; ++z) P::store(wq + z * kVec, P::lut(P::load(wq + z * kVec)));
  }
}

// Field J (bits 2J..2J+1 of each byte) of a Q6_K 2-bit plane unit at bits 4..5, bits 6..7 zero, bits 0..3 anything:
// from q = plane & 0x33 (fields 0, 2) or r = plane & 0xCC (fields 1, 3), so a 16-bit shift brings in only zeros or
// bits that a merge with the nibble (bits 0..3 from it, 4..7 from the field) discards. V: one vector register whose
// 16-bit shifts P provides (P::sll, P::srl).
template <class P, int J, class V>
inline V q6_field(V q, V r) {
  if constexpr (J == 0) return P::sll(q, 4);
  if constexpr (J == 1) return P::sll(r, 2);
  if constexpr (J == 2) return q;
  return P::srl(r, 2);
}

// dw (and mw) of a chunk's sub-blocks, 16 columns each, from its scale section s.
template <class P>
__attribute__((always_inline)) inline void decode_scales(const QType& t, const uint8_t* s, float* dw, float* mw) {
  const auto d = P::half(s);
  switch (t.sk) {
    case ScaleKind::kD: P::store(dw, d); return;
    case ScaleKind::kDM:
      P::store(dw, d);
      P::store(mw, P::half(s + 32));
      return;
    case ScaleKind::kK4: {
      const auto dm = P::half(s + 32);
      for (int i = 0; i < 8; ++i) {
        P::store(dw + i * kPanel, P::mul(d, P::u8(s + 64 + i * kPanel)));
        P::store(mw + i * kPanel, P::neg(P::mul(dm, P::u8(s + 64 + 128 + i * kPanel))));
      }
      return;
    }
    case ScaleKind::kS8:
      for (int i = 0; i < t.nsub(); ++i) P::store(dw + i * kPanel, P::mul(d, P::s8(s + 32 + i * kPanel)));
      return;
    case ScaleKind::kQ2: {
      const auto dm = P::half(s + 32);
      for (int i = 0; i < 16; ++i) {
        P::store(dw + i * kPanel, P::mul(d, P::lo4(s + 64 + i * kPanel)));
        P::store(mw + i * kPanel, P::neg(P::mul(dm, P::hi4(s + 64 + i * kPanel))));
      }
      return;
    }
  }
}

template <class P, int QB, bool NIB, int P2, int P1, bool RAW, bool LUT>
void decode_run(const QType& t, const uint8_t* packed, int64_t n, const Dec& d) {
  const int64_t cb = t.chunk_bytes(), ns = t.nsub() * kPanel;
  for (int64_t c = 0; c < n; ++c) {
    const uint8_t* ch = packed + c * cb;
    prefetch_ahead(ch, cb);  // panels stream from DRAM (common.h)
    decode_scales<P>(t, ch, d.dw + c * ns, d.mw + c * ns);
    decode_values<P, QB, NIB, P2, P1, RAW, LUT>(ch + t.scale_bytes(), d.wq + c * QB * kPanel);
  }
}

// Ops::decode for policy P: one instantiation per packed format.
template <class P>
void decode(const QType& t, const uint8_t* packed, int64_t n, const Dec& d) {
  switch (t.id) {
    case 2: case 3: return decode_run<P, 32, true, -1, -1, false, false>(t, packed, n, d);    // Q4_0, Q4_1
    case 6: case 7: return decode_run<P, 32, true, -1, 4, false, false>(t, packed, n, d);     // Q5_0, Q5_1
    case 8: return decode_run<P, 32, false, -1, -1, true, false>(t, packed, n, d);            // Q8_0
    case 10: return decode_run<P, 256, false, 0, -1, false, false>(t, packed, n, d);          // Q2_K
    case 11: return decode_run<P, 256, false, 0, 2, false, false>(t, packed, n, d);           // Q3_K
    case 12: return decode_run<P, 256, true, -1, -1, false, false>(t, packed, n, d);          // Q4_K
    case 13: return decode_run<P, 256, true, -1, 4, false, false>(t, packed, n, d);           // Q5_K
    case 14: return decode_run<P, 256, true, 4, -1, false, false>(t, packed, n, d);           // Q6_K
    case 20: return decode_run<P, 32, true, -1, -1, false, true>(t, packed, n, d);            // IQ4_NL
    case 23: return decode_run<P, 256, true, -1, -1, false, true>(t, packed, n, d);           // IQ4_XS
    default: return;
  }
}

}  // namespace pdserve::qgemm
