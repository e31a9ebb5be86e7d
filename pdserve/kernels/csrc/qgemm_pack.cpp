// The GGUF block types the qgemm kernels multiply, and their repacking (once, at load) from the file's blocks into
// the panel layout of qgemm.h. Scalar on purpose: it runs once per weight and its bit order is the contract every
// ISA level's decoder reads back.
#include <cstring>

#include "qgemm.h"

namespace pdserve::qgemm {
namespace {

using SK = ScaleKind;
//                       id  name      qb  bytes  s  off  min    nib    p2  p1  raw    lut    scales
constexpr QType kTypes[] = {{2, "Q4_0", 32, 18, 32, 8, false, true, -1, -1, false, false, SK::kD},
                            {3, "Q4_1", 32, 20, 32, 0, true, true, -1, -1, false, false, SK::kDM},
                            {6, "Q5_0", 32, 22, 32, 16, false, true, -1, 4, false, false, SK::kD},
                            {7, "Q5_1", 32, 24, 32, 0, true, true, -1, 4, false, false, SK::kDM},
                            {8, "Q8_0", 32, 34, 32, 128, false, false, -1, -1, true, false, SK::kD},
                            {10, "Q2_K", 256, 84, 16, 0, true, false, 0, -1, false, false, SK::kQ2},
                            {11, "Q3_K", 256, 110, 16, 4, false, false, 0, 2, false, false, SK::kS8},
                            {12, "Q4_K", 256, 144, 32, 0, true, true, -1, -1, false, false, SK::kK4},
                            {13, "Q5_K", 256, 176, 32, 0, true, true, -1, 4, false, false, SK::kK4},
                            {14, "Q6_K", 256, 210, 16, 32, false, true, 4, -1, false, false, SK::kS8},
                            {20, "IQ4_NL", 32, 18, 32, 128, false, true, -1, -1, false, true, SK::kD},
                            {23, "IQ4_XS", 256, 136, 32, 128, false, true, -1, -1, false, true, SK::kS8},
                            {0, nullptr, 0, 0, 0, 0, false, false, -1, -1, false, false, SK::kD}};

// One column's GGUF block in a canonical form: the decoded byte of every value (before the IQ4 table) and the
// scale fields as stored (d2: dmin or m; sc/m: sub-block scales and mins as the chunk stores them).
struct Block {
  uint8_t v[256];
  uint16_t d, d2;
  uint8_t sc[16], m[16];
};

uint16_t u16(const uint8_t* p) {
  uint16_t x;
  std::memcpy(&x, p, 2);
  return x;
}

// Values of a 32-block whose 16 bytes hold value j in the low nibble and value j + 16 in the high one.
void nibbles32(const uint8_t* qs, uint8_t* v) {
  for (int j = 0; j < 16; ++j) {
    v[j] = qs[j] & 0xF;
    v[j + 16] = qs[j] >> 4;
  }
}

// Q4_K/Q5_K: 64 values per 32 bytes, the low nibbles first.
void nibbles256(const uint8_t* qs, uint8_t* v) {
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      v[64 * j + l] = qs[32 * j + l] & 0xF;
      v[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
}

// The 6-bit scales and mins of Q4_K/Q5_K (ggml's get_scale_min_k4).
void scale_min_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      m[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

// Q2_K/Q3_K: value 128g + 32i + l is bits 2i..2i+1 of qs[32g + l].
void crumbs256(const uint8_t* qs, uint8_t* v) {
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) v[128 * g + 32 * i + l] = (qs[32 * g + l] >> (2 * i)) & 3;
}

void parse_legacy(const QType& t, const uint8_t* b, Block& o) {
  o.d = u16(b);
  const bool has_m = t.sk == SK::kDM;
  if (has_m) o.d2 = u16(b + 2);
  const uint8_t* p = b + (has_m ? 4 : 2);
  if (t.raw) {
    for (int j = 0; j < 32; ++j) o.v[j] = p[j] ^ 0x80;
    return;
  }
  uint32_t qh = 0;
  if (t.p1 >= 0) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  nibbles32(p, o.v);
  if (t.p1 >= 0)
    for (int j = 0; j < 32; ++j) o.v[j] |= ((qh >> j) & 1) << 4;
}

void parse_q6k(const uint8_t* b, Block& o) {
  const uint8_t *ql = b, *qh = b + 128;
  for (int g = 0; g < 2; ++g)
    for (int l = 0; l < 64; ++l) {
      o.v[128 * g + l] = ql[64 * g + l] & 0xF;
      o.v[128 * g + 64 + l] = ql[64 * g + l] >> 4;
    }
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) o.v[128 * g + 32 * i + l] |= ((qh[32 * g + l] >> (2 * i)) & 3) << 4;
  std::memcpy(o.sc, b + 192, 16);
  o.d = u16(b + 208);
}

void parse_q3k(const uint8_t* b, Block& o) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  crumbs256(qs, o.v);
  for (int i = 0; i < 8; ++i)
    for (int l = 0; l < 32; ++l) o.v[32 * i + l] |= ((hmask[l] >> i) & 1) << 2;
  for (int j = 0; j < 16; ++j) {
    const int lo = (sc[j % 8] >> (4 * (j / 8))) & 0xF, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    o.sc[j] = static_cast<uint8_t>(static_cast<int8_t>((lo | (hi << 4)) - 32));
  }
  o.d = u16(b + 108);
}

void parse_iq4xs(const uint8_t* b, Block& o) {
  o.d = u16(b);
  const uint16_t sh = u16(b + 2);
  const uint8_t *sl = b + 4, *qs = b + 8;
  for (int i = 0; i < 8; ++i) {
    const int ls = ((sl[i / 2] >> (4 * (i % 2))) & 0xF) | (((sh >> (2 * i)) & 3) << 4);
    o.sc[i] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
    nibbles32(qs + 16 * i, o.v + 32 * i);
  }
}

void parse(const QType& t, const uint8_t* b, Block& o) {
  switch (t.id) {
    case 10:  // Q2_K: scales[16], qs[64], d, dmin
      std::memcpy(o.sc, b, 16);
      crumbs256(b + 16, o.v);
      o.d = u16(b + 80);
      o.d2 = u16(b + 82);
      return;
    case 11: parse_q3k(b, o); return;
    case 12:
    case 13:  // Q4_K/Q5_K: d, dmin, scales[12], (qh[32],) qs[128]
      o.d = u16(b);
      o.d2 = u16(b + 2);
      scale_min_k4(b + 4, o.sc, o.m);
      nibbles256(b + (t.id == 13 ? 48 : 16), o.v);
      if (t.id == 13)
        for (int i = 0; i < 8; ++i)
          for (int l = 0; l < 32; ++l) o.v[32 * i + l] |= ((b[16 + l] >> i) & 1) << 4;
      return;
    case 14: parse_q6k(b, o); return;
    case 23: parse_iq4xs(b, o); return;
    default: parse_legacy(t, b, o);
  }
}

void put16(uint8_t* p, uint16_t x) { std::memcpy(p, &x, 2); }

// Column c's scale fields into the chunk's scale section.
void write_scales(const QType& t, const Block& b, int c, uint8_t* s) {
  put16(s + 2 * c, b.d);
  const int nsub = t.nsub();
  switch (t.sk) {
    case SK::kD: return;
    case SK::kDM: put16(s + 32 + 2 * c, b.d2); return;
    case SK::kK4:
      put16(s + 32 + 2 * c, b.d2);
      for (int i = 0; i < 8; ++i) {
        s[64 + i * kPanel + c] = b.sc[i];
        s[64 + 128 + i * kPanel + c] = b.m[i];
      }
      return;
    case SK::kS8:
      for (int i = 0; i < nsub; ++i) s[32 + i * kPanel + c] = b.sc[i];
      return;
    case SK::kQ2:
      put16(s + 32 + 2 * c, b.d2);
      for (int i = 0; i < 16; ++i) s[64 + i * kPanel + c] = b.sc[i];
      return;
  }
}

// Column c's values into the chunk's bit sections (chunk: its values' start; see qgemm.h).
void write_values(const QType& t, const Block& b, int c, uint8_t* chunk) {
  const int z2 = t.z() / 2;
  for (int k = 0; k < t.qb; ++k) {
    const int z = k / 4, byte = 4 * c + k % 4;
    const uint8_t v = b.v[k];
    if (t.nib) {
      uint8_t& u = chunk[(z % z2) * kVec + byte];
      u |= z < z2 ? (v & 0xF) : (v & 0xF) << 4;
    }
    if (t.p2 >= 0) chunk[t.off_p2() + (z / 4) * kVec + byte] |= ((v >> t.p2) & 3) << (2 * (z % 4));
    if (t.p1 >= 0) chunk[t.off_p1() + (z / 8) * kVec + byte] |= ((v >> t.p1) & 1) << (z % 8);
    if (t.raw) chunk[t.off_raw() + z * kVec + byte] = v;
  }
}

}  // namespace

const QType* find_type(int id) {
  for (const QType* t = kTypes; t->name; ++t)
    if (t->id == id) return t;
  return nullptr;
}

const QType* all_types() { return kTypes; }

namespace {
size_t align64(size_t n) { return (n + 63) / 64 * 64; }

// Act's tile rows T = 2^lt (qgemm.h): the power of two from m up to 16, so fewer than 16 rows (decodes of small
// batches) leave no padding rows between them.
int act_tile_log2(int64_t m) {
  int lt = 0;
  while (lt < 4 && (int64_t{1} << lt) < m) ++lt;
  return lt;
}
int64_t padded_rows(int64_t m, int lt) { return (m + (int64_t{1} << lt) - 1) >> lt << lt; }
}  // namespace

size_t act_bytes(const QType& t, int64_t m, int64_t k) {
  m = padded_rows(m, act_tile_log2(m));
  const size_t nsub = static_cast<size_t>(m * (k / t.s)), nb = static_cast<size_t>(m * (k / QK));
  return align64(static_cast<size_t>(m * k)) + align64(4 * nb) + 2 * align64(4 * nsub);
}

Act act_view(const QType& t, int64_t m, int64_t k, uint8_t* buf) {
  const int lt = act_tile_log2(m);
  m = padded_rows(m, lt);
  const size_t nsub = static_cast<size_t>(m * (k / t.s)), nb = static_cast<size_t>(m * (k / QK));
  Act a;
  a.q = reinterpret_cast<int8_t*>(buf);
  buf += align64(static_cast<size_t>(m * k));
  a.dx = reinterpret_cast<float*>(buf);
  buf += align64(4 * nb);
  a.init = reinterpret_cast<int32_t*>(buf);
  buf += align64(4 * nsub);
  a.xs = reinterpret_cast<float*>(buf);
  a.k = k;
  a.nb32 = k / QK;
  a.nsub = k / t.s;
  a.s = t.s;
  a.lt = lt;
  return a;
}

void zero_rows(const Act& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t sub = 0; sub < a.nsub; ++sub) {
      std::memset(a.q + a.qi(r, sub), 0, static_cast<size_t>(a.s));
      a.init[a.si(r, sub)] = 0;
      a.xs[a.si(r, sub)] = 0.0f;
    }
    for (int64_t b = 0; b < a.nb32; ++b) a.dx[a.di(r, b)] = 0.0f;
  }
}

size_t dec_bytes(const QType& t, int64_t nchunks) {
  const size_t scales = static_cast<size_t>(nchunks * t.nsub() * kPanel * 4);
  return static_cast<size_t>(nchunks * t.qb * kPanel) + 2 * scales;
}

Dec dec_view(const QType& t, int64_t nchunks, uint8_t* buf) {
  const size_t wq = static_cast<size_t>(nchunks * t.qb * kPanel), scales = static_cast<size_t>(nchunks * t.nsub() * kPanel);
  return {buf, reinterpret_cast<float*>(buf + wq), reinterpret_cast<float*>(buf + wq) + scales};
}

void pack_panels(const QType& t, const uint8_t* data, int64_t n, int64_t k, int64_t p0, int64_t p1, uint8_t* out) {
  const int64_t nchunks = k / t.qb, row_bytes = nchunks * t.gguf_bytes, cb = t.chunk_bytes();
  Block b;
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* panel = out + p * nchunks * cb;
    std::memset(panel, 0, static_cast<size_t>(nchunks * cb));
    for (int c = 0; c < kPanel && p * kPanel + c < n; ++c) {
      const uint8_t* row = data + (p * kPanel + c) * row_bytes;
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        std::memset(&b, 0, sizeof b);
        parse(t, row + ch * t.gguf_bytes, b);
        write_scales(t, b, c, panel + ch * cb);
        write_values(t, b, c, panel + ch * cb + t.scale_bytes());
      }
    }
  }
}

}  // namespace pdserve::qgemm
