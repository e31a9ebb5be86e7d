// PackedWeight over GGUF blocks (qgemm.h): pack_gguf, the forward's threading and buffers, dequantize and rows.
// The arithmetic lives in qgemm_{generic,avx2,avx512,amx}.cpp, picked per call through one IsaTable.
#include <torch/extension.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "parallel.h"
#include "dispatch.h"
#include "fgemm_kernels.h"
#include "packed_weight.h"
#include "qgemm.h"
#include "registry.h"

namespace pdserve {
namespace {

using qgemm::kPanel;

const qgemm::Ops& ops() {
  static const IsaTable<const qgemm::Ops*> table = {
      {Isa::kGeneric, &qgemm::kGenericOps},
      PDSERVE_X86({Isa::kAvx2, &qgemm::kAvx2Ops}, {Isa::kAvx512, &qgemm::kAvx512Ops}, {Isa::kAmx, &qgemm::kAmxOps})};
  return *table.pick();
}

// A grow-only 64-byte-aligned scratch buffer (one per thread: no allocation on the hot path once warm).
class Scratch {
 public:
  uint8_t* get(size_t bytes) {
    if (bytes > size_) {
      size_ = (bytes + 4095) / 4096 * 4096;
      buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size_)));
      TORCH_CHECK(buf_, "out of memory for a ", size_, "-byte kernel buffer");
    }
    return buf_.get();
  }

 private:
  struct Free { void operator()(uint8_t* p) const { std::free(p); } };
  std::unique_ptr<uint8_t, Free> buf_;
  size_t size_ = 0;
};

// A buffer the forward streams: from 2 MiB on, 2 MiB-aligned and advised into transparent huge pages (where the
// system leaves THP to madvise, as Debian does). A decode GEMV over 4 KiB pages streamed 7 GB/s on one core here,
// over huge pages 10.7 GB/s, the core's read bandwidth (measured on a 19 MB Q4_K weight, cold).
at::Tensor stream_buffer(int64_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (static_cast<size_t>(bytes) < kHuge) return at::empty({bytes}, at::kByte);
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kHuge, static_cast<size_t>(bytes)) == 0, "out of memory for ", bytes,
              " bytes of packed weights");
#if defined(__linux__)
  madvise(p, static_cast<size_t>(bytes), MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
#endif
  return at::from_blob(p, {bytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

class QgemmWeight final : public PackedWeight {
 public:
  QgemmWeight(const qgemm::QType& t, const at::Tensor& data, int64_t n, int64_t k)
      : PackedWeight(n, k), t_(t), nchunks_(k / t.qb), npanels_((n + kPanel - 1) / kPanel) {
    packed_ = stream_buffer(npanels_ * nchunks_ * t.chunk_bytes());
    const uint8_t* src = data.data_ptr<uint8_t>();
    uint8_t* dst = packed_.data_ptr<uint8_t>();
    parallel_for(0, npanels_, 1, [&](int64_t p0, int64_t p1) { qgemm::pack_panels(t_, src, n, k, p0, p1, dst); });
  }

  std::string type_name() const override { return t_.name; }
  int64_t nbytes() const override { return packed_.numel(); }
  void forward(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias) const override;
  bool takes_slabs() const override { return ops().decode_bf16 == nullptr; }
  bool forward_slab(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias, int64_t c0,
                    int64_t nc, int64_t k0, int64_t kn, bool accumulate, XReuse x_reuse) const override;
  void forward_rows(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                    const uint8_t* prompt_rows) const override;
  bool forward_gated(const float* x, int64_t ldx, int64_t m, float* act, int64_t ld_act, GatedMulFn gated,
                     const uint8_t* prompt_rows) const override;
  at::Tensor dequantize() const override;
  void rows(const int64_t* ids, int64_t t, float* out) const override;

 private:
  // What one pass multiplies: panels [p0, p1) (y and bias start at column 16 p0), chunks [ch0, ch0 + nch) of each
  // (the Act's K), and whether the fp32 accumulators start from y (a later K range) or from zero.
  struct Slab {
    int64_t p0, p1, ch0, nch;
    bool accumulate;
    XReuse x_reuse;
  };
  const uint8_t* panel(int64_t p) const { return packed_.data_ptr<uint8_t>() + p * nchunks_ * t_.chunk_bytes(); }
  void run(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias, const Slab& sl) const;
  void run_few(const qgemm::Ops& o, const qgemm::Act& a, int64_t m, int64_t p0, int64_t p1, float* y, int64_t ldy,
               const float* bias, const Slab& sl) const;
  void run_many(const qgemm::Ops& o, const qgemm::Act& a, int64_t m, int64_t p0, int64_t p1, float* y, int64_t ldy,
                const float* bias, const Slab& sl) const;
  // acc [rows][16] for panel p's rows r0..r0+mr: zero, or y's values (a later K range of the slab)
  void load(float* acc, int64_t p, int64_t r0, int64_t mr, const float* y, int64_t ldy, const Slab& sl) const;
  void store(const float* acc, int64_t p, int64_t r0, int64_t mr, float* y, int64_t ldy, const float* bias,
             const Slab& sl) const;
  // Prompt rows on the amx level: bf16 AMX tiles (fgemm's kernel) over panels dequantized to bf16 per call.
  void forward_bf16(const qgemm::Ops& o, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
                    const float* bias) const;
  // Columns c0 <= c < c1 of panel p, dequantized, into out[(c - c0) * k].
  void dequant_panel(int64_t p, int c0, int c1, float* out) const;

  const qgemm::QType& t_;
  int64_t nchunks_, npanels_;
  at::Tensor packed_;
};

void QgemmWeight::load(float* acc, int64_t p, int64_t r0, int64_t mr, const float* y, int64_t ldy,
                       const Slab& sl) const {
  std::fill(acc, acc + mr * kPanel, 0.0f);
  if (!sl.accumulate) return;
  const int64_t c0 = (p - sl.p0) * kPanel, nc = std::min<int64_t>(kPanel, n() - p * kPanel);
  for (int64_t r = 0; r < mr; ++r) std::copy_n(y + (r0 + r) * ldy + c0, nc, acc + r * kPanel);
}

void QgemmWeight::store(const float* acc, int64_t p, int64_t r0, int64_t mr, float* y, int64_t ldy,
                        const float* bias, const Slab& sl) const {
  const int64_t c0 = (p - sl.p0) * kPanel, nc = std::min<int64_t>(kPanel, n() - p * kPanel);
  for (int64_t r = 0; r < mr; ++r) {
    float* yr = y + (r0 + r) * ldy + c0;
    const float* ar = acc + r * kPanel;
    for (int64_t c = 0; c < nc; ++c) yr[c] = bias ? ar[c] + bias[c0 + c] : ar[c];
  }
}

// What a thread's kept activation quantization was made from (QgemmWeight::run): x, its shape and the format.
struct KeptX {
  const float* x = nullptr;
  int64_t ldx = 0, m = 0, k = 0;
  int type = -1;
  const qgemm::Ops* level = nullptr;  // the ISA level (its quantizer and Act layout)
  bool operator==(const KeptX& o) const = default;
};

// Rows from which the amx level multiplies on AMX tiles (all rows then: the activations are padded to 16-row tiles).
// benchmarks/kernels_qgemm.py here: at 16 rows the VNNI tiles were as fast or faster (up to 1.25x), from 32 AMX won.
constexpr int64_t kAmxMinRows = 32;
// Decoded panels per block on the many-rows path: the block (in L2) serves every row tile while a row tile's
// activations stay in L1/L2 across the block's panels.
constexpr size_t kBlockBytes = size_t{1} << 19;

bool use_amx(const qgemm::Ops& o, int64_t m) { return o.tile16 && m > o.max_rows && m >= kAmxMinRows; }

// Row tiles of one panel on the few-rows path, at most (Ops::few_rows).
constexpr int64_t kFewRowsMax = 64;

// Few rows: per panel, accumulators for every row carried along K; each row tile's weight vectors decoded in
// registers straight from the packed panel where the level can (gemv), else ~256 values of K at a time into L1 for
// all the row tiles. (A prefetch of the next group into L1 here, kept from an Intel measurement, made the AVX2 level
// 1.6x slower on Zen 4 than no software prefetch; the L2 prefetch inside the decoders replaced it.)
void QgemmWeight::run_few(const qgemm::Ops& o, const qgemm::Act& a, int64_t m, int64_t p0, int64_t p1, float* y,
                          int64_t ldy, const float* bias, const Slab& sl) const {
  thread_local Scratch dec_buf, acc_buf;
  float* acc = reinterpret_cast<float*>(acc_buf.get(sizeof(float) * kPanel * kFewRowsMax));
  const int64_t cb = t_.chunk_bytes(), ns = t_.nsub(), group = std::max<int64_t>(1, 256 / t_.qb), step = o.max_rows;
  const qgemm::Dec d = qgemm::dec_view(t_, group, dec_buf.get(qgemm::dec_bytes(t_, group)));
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* first = panel(p) + sl.ch0 * cb;
    load(acc, p, 0, m, y, ldy, sl);
    // a level's gemv takes a (type, rows) or leaves it all to the decode path: the first row tile, the widest, tells
    bool in_registers = o.gemv != nullptr;
    for (int64_t r0 = 0; in_registers && r0 < m; r0 += step)
      in_registers = o.gemv(t_, first, sl.nch, a, r0, std::min(step, m - r0), acc + r0 * kPanel);
    if (!in_registers) {
      load(acc, p, 0, m, y, ldy, sl);
      for (int64_t c0 = 0; c0 < sl.nch; c0 += group) {
        const int64_t g = std::min(group, sl.nch - c0);
        o.decode(t_, first + c0 * cb, g, d);  // prefetches the stream into L2 ahead of itself (prefetch_ahead)
        for (int64_t r0 = 0; r0 < m; r0 += step)
          o.tile(t_, d, g * ns, a, c0 * ns, r0, std::min(step, m - r0), acc + r0 * kPanel);
      }
    }
    store(acc, p, 0, m, y, ldy, bias, sl);
  }
}

// More rows: decode a block of panels whole (L2) and run every row tile over each (AMX tiles of 16 rows where the
// level has them). As on the few-rows path, each output is one fixed sequence of operations over K (qgemm.h).
void QgemmWeight::run_many(const qgemm::Ops& o, const qgemm::Act& a, int64_t m, int64_t p0, int64_t p1, float* y,
                           int64_t ldy, const float* bias, const Slab& sl) const {
  thread_local Scratch dec_buf, acc_buf;
  float* acc = reinterpret_cast<float*>(acc_buf.get(sizeof(float) * kPanel * 32));
  const bool amx = use_amx(o, m), pairs = !amx && o.tile2 != nullptr;
  const int64_t ns = t_.nsub(), step = amx ? 16 : pairs ? o.max_rows2 : o.max_rows, nch = sl.nch;
  const int64_t first = sl.ch0 * t_.chunk_bytes();  // a panel's first chunk of the slab
  const size_t per = qgemm::dec_bytes(t_, nch);
  int64_t pb = std::clamp<int64_t>(static_cast<int64_t>(kBlockBytes / per), 1, 16);
  // blocks of whole pairs where the level pairs panels: an odd block's last panel ran alone, a broadcast per product
  // instead of per two (K = 8192 Q4_K: 3 panels a block; 2 pairs measured faster, BENCHMARKS.md)
  if (pairs) pb = std::max<int64_t>(2, pb / 2 * 2);
  uint8_t* buf = dec_buf.get(per * pb);
  for (int64_t b0 = p0; b0 < p1; b0 += pb) {
    const int64_t nb = std::min(pb, p1 - b0);
    for (int64_t j = 0; j < nb; ++j)
      (amx ? o.decode16 : o.decode)(t_, panel(b0 + j) + first, nch, qgemm::dec_view(t_, nch, buf + j * per));
    for (int64_t r0 = 0, mr; r0 < m; r0 += mr) {
      const int64_t tr = a.tile_rows();
      mr = std::min({step, m - r0, tr - r0 % tr});  // a row tile stays within one of Act's tiles
      for (int64_t j = 0; j < nb; ++j) {
        const qgemm::Dec d = qgemm::dec_view(t_, nch, buf + j * per);
        const bool paired = pairs && j + 1 < nb;
        if (paired) {  // two panels a pass: each activation broadcast feeds both
          float* acc1 = acc + step * kPanel;
          load(acc, b0 + j, r0, mr, y, ldy, sl);
          load(acc1, b0 + j + 1, r0, mr, y, ldy, sl);
          o.tile2(t_, d, qgemm::dec_view(t_, nch, buf + (j + 1) * per), nch * ns, a, 0, r0, mr, acc, acc1);
          store(acc, b0 + j, r0, mr, y, ldy, bias, sl);
          store(acc1, b0 + ++j, r0, mr, y, ldy, bias, sl);
          continue;
        }
        load(acc, b0 + j, r0, amx ? 16 : mr, y, ldy, sl);
        if (amx) o.tile16(t_, d, nch * ns, a, 0, r0, acc);
        else o.tile(t_, d, nch * ns, a, 0, r0, mr, acc);
        store(acc, b0 + j, r0, mr, y, ldy, bias, sl);
      }
    }
  }
  if (amx) o.end16();
}

void QgemmWeight::forward(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias) const {
  run(x, ldx, m, y, ldy, bias, Slab{0, npanels_, 0, nchunks_, false, kXOnce});
}

bool QgemmWeight::forward_slab(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                               int64_t c0, int64_t nc, int64_t k0, int64_t kn, bool accumulate,
                               XReuse x_reuse) const {
  const bool cols = c0 >= 0 && nc > 0 && c0 + nc <= n() && c0 % kPanel == 0 && (nc % kPanel == 0 || c0 + nc == n());
  const bool ks = k0 >= 0 && kn > 0 && k0 + kn <= k() && k0 % t_.qb == 0 && kn % t_.qb == 0;
  if (!takes_slabs() || !cols || !ks) return false;
  run(x, ldx, m, y, ldy, bias,
      Slab{c0 / kPanel, (c0 + nc + kPanel - 1) / kPanel, k0 / t_.qb, kn / t_.qb, accumulate, x_reuse});
  return true;
}

void QgemmWeight::run(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                      const Slab& sl) const {
  const qgemm::Ops& o = ops();
  // the calling thread's activation scratch, and the one whose quantization a caller may keep for later calls
  // (Slab::x_reuse), with what it holds
  thread_local Scratch act_buf, kept_buf;
  thread_local KeptX kept;
  const int64_t rows = use_amx(o, m) ? (m + 15) / 16 * 16 : m, kn = sl.nch * t_.qb;  // AMX tiles: whole 16-row tiles
  // an accumulating slab reads y's rows back: never padding rows (slabs run below the amx level: takes_slabs)
  TORCH_CHECK(!sl.accumulate || rows == m, "qgemm: an accumulating slab on padded AMX rows");
  const bool keep = sl.x_reuse != kXOnce;
  const KeptX key{x, ldx, m, kn, t_.id, &o};
  const qgemm::Act a = qgemm::act_view(t_, rows, kn, (keep ? kept_buf : act_buf).get(qgemm::act_bytes(t_, rows, kn)));
  if (!(sl.x_reuse == kXKept && kept == key)) {
    parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { o.quantize_act(t_, x, ldx, r0, r1, a); });
    if (rows > m) qgemm::zero_rows(a, m, rows);
    if (keep) kept = key;
  }
  const int64_t threads = num_threads(), np = sl.p1 - sl.p0;
  const int64_t grain = (np + threads - 1) / threads;  // even split: each thread one contiguous stream
  const bool few = m <= o.max_rows || (o.few_rows && !use_amx(o, m) && m <= std::min(kFewRowsMax, o.few_rows(t_)));
  parallel_for(sl.p0, sl.p1, grain, [&](int64_t p0, int64_t p1) {
    if (few) run_few(o, a, m, p0, p1, y, ldy, bias, sl);
    else run_many(o, a, m, p0, p1, y, ldy, bias, sl);
  });
}

// Prompt rows (a prefill's, many per step) multiply faster as bf16 on AMX tiles than as int8 tiles whose fp32
// scales must be applied per 32-value sub-block; the panels are dequantized once per call for all the rows.
// The arithmetic is fgemm's "block" order over bf16(dequantized W) and bf16(x), fixed per row (packed_weight.h):
// the same bits as pack_float(dequantize(), "bf16") gives on this level.
void QgemmWeight::forward_bf16(const qgemm::Ops& o, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
                               const float* bias) const {
#if defined(__x86_64__)
  const fgemm::Kernels& kn = fgemm::kAmx;
  const int64_t kp = k();  // a multiple of fgemm::kKBlock: every type's block is 32 or 256 values
  thread_local Scratch xb_buf;  // the caller's: the workers read it through this pointer
  uint16_t* xb = reinterpret_cast<uint16_t*>(xb_buf.get(sizeof(uint16_t) * ((m + 15) / 16 * 16) * kp));
  fgemm::bf16_activations(kn, x, ldx, m, kp, kp, true, xb);
  const int64_t pairs = (npanels_ + 1) / 2, threads = num_threads();
  const int64_t group = fgemm::panel_group(kp);  // panels decoded together: each serves every row chunk
  parallel_for(0, pairs, (pairs + threads - 1) / threads, [&](int64_t a0, int64_t a1) {
    thread_local Scratch dec_buf, w_buf;
    const qgemm::Dec d = qgemm::dec_view(t_, nchunks_, dec_buf.get(qgemm::dec_bytes(t_, nchunks_)));
    const int64_t ps = kp * kPanel;  // bf16 values of one panel
    uint16_t* w = reinterpret_cast<uint16_t*>(w_buf.get(sizeof(uint16_t) * group * ps));
    const int64_t end = std::min(2 * a1, npanels_);
    for (int64_t p = 2 * a0; p < end; p += group) {
      const int64_t np = std::min(group, end - p), c0 = p * kPanel;
      for (int64_t j = 0; j < np; ++j) o.decode_bf16(t_, panel(p + j), nchunks_, d, w + j * ps);
      const fgemm::Problem pr{w, kp, n() - c0, nullptr, xb, kp, true, m, y + c0, ldy, bias ? bias + c0 : nullptr};
      fgemm::run_row_chunks(kn.bf16, pr, 0, np);
    }
  });
#else
  (void)o, (void)x, (void)ldx, (void)m, (void)y, (void)ldy, (void)bias;
  TORCH_CHECK(false, "no bf16 prompt-row path on this architecture");
#endif
}

// Prompt rows of a gate/up projection (gate panels, then as many up panels) straight to act = gated(gate, up): each
// thread decodes a group of gate panels and their up panels, and fgemm's AMX kernel multiplies each gate panel
// beside its up panel and applies `gated` to the pair's C tiles. No [m, 2I] output is written and read back.
bool QgemmWeight::forward_gated(const float* x, int64_t ldx, int64_t m, float* act, int64_t ld_act,
                                GatedMulFn gated, const uint8_t* prompt_rows) const {
  const qgemm::Ops& o = ops();
  if (prompt_rows == nullptr || o.decode_bf16 == nullptr || n() % (2 * kPanel) != 0) return false;
  if (!std::all_of(prompt_rows, prompt_rows + m, [](uint8_t k) { return k != 0; })) return false;
#if defined(__x86_64__)
  const fgemm::Kernels& kn = fgemm::kAmx;
  const int64_t kp = k(), half = npanels_ / 2, threads = num_threads();
  thread_local Scratch xb_buf;
  uint16_t* xb = reinterpret_cast<uint16_t*>(xb_buf.get(sizeof(uint16_t) * ((m + 15) / 16 * 16) * kp));
  fgemm::bf16_activations(kn, x, ldx, m, kp, kp, true, xb);
  const int64_t group = fgemm::panel_group(kp) / 2;  // gate panels a group: with their up panels, an L2 group
  parallel_for(0, half, (half + threads - 1) / threads, [&](int64_t g0, int64_t g1) {
    thread_local Scratch dec_buf, w_buf;
    const qgemm::Dec d = qgemm::dec_view(t_, nchunks_, dec_buf.get(qgemm::dec_bytes(t_, nchunks_)));
    const int64_t ps = kp * kPanel;
    uint16_t* w = reinterpret_cast<uint16_t*>(w_buf.get(sizeof(uint16_t) * 2 * group * ps));
    for (int64_t p = g0; p < g1; p += group) {
      const int64_t np = std::min(group, g1 - p);
      for (int64_t j = 0; j < np; ++j) {
        o.decode_bf16(t_, panel(p + j), nchunks_, d, w + j * ps);
        o.decode_bf16(t_, panel(half + p + j), nchunks_, d, w + (np + j) * ps);
      }
      fgemm::Problem pr{w, kp, np * kPanel, nullptr, xb, kp, true, m, act + p * kPanel, ld_act, nullptr};
      pr.gated = gated;
      pr.up = np;
      fgemm::run_row_chunks(kn.bf16, pr, 0, np);
    }
  });
  return true;
#else
  (void)x, (void)ldx, (void)act, (void)ld_act, (void)gated;
  return false;
#endif
}

void QgemmWeight::forward_rows(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                               const uint8_t* prompt_rows) const {
  const qgemm::Ops& o = ops();
  if (prompt_rows == nullptr || o.decode_bf16 == nullptr) return forward(x, ldx, m, y, ldy, bias);
  std::vector<int64_t> rows[2];  // generated rows, prompt rows
  for (int64_t r = 0; r < m; ++r) rows[prompt_rows[r] != 0].push_back(r);
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<int64_t>& rs = rows[kind];
    const int64_t cnt = static_cast<int64_t>(rs.size());
    if (cnt == 0) continue;
    const auto run = [&](const float* xs, int64_t ldxs, float* ys, int64_t ldys) {
      if (kind == 1) forward_bf16(o, xs, ldxs, cnt, ys, ldys, bias);
      else forward(xs, ldxs, cnt, ys, ldys, bias);
    };
    if (rs.back() - rs.front() + 1 == cnt) {  // one run of consecutive rows (the usual step)
      run(x + rs.front() * ldx, ldx, y + rs.front() * ldy, ldy);
      continue;
    }
    at::Tensor xs = at::empty({cnt, k()}, at::kFloat), ys = at::empty({cnt, n()}, at::kFloat);
    float *xp = xs.data_ptr<float>(), *yp = ys.data_ptr<float>();
    for (int64_t i = 0; i < cnt; ++i) std::memcpy(xp + i * k(), x + rs[i] * ldx, sizeof(float) * k());
    run(xp, k(), yp, n());
    for (int64_t i = 0; i < cnt; ++i) std::memcpy(y + rs[i] * ldy, yp + i * n(), sizeof(float) * n());
  }
}

void QgemmWeight::dequant_panel(int64_t p, int c0, int c1, float* out) const {
  thread_local Scratch buf;
  const qgemm::Dec d = qgemm::dec_view(t_, nchunks_, buf.get(qgemm::dec_bytes(t_, nchunks_)));
  ops().decode(t_, panel(p), nchunks_, d);
  qgemm::dequant_decoded(t_, d, nchunks_, c0, c1, out, k());
}

at::Tensor QgemmWeight::dequantize() const {
  at::Tensor out = at::empty({n(), k()}, at::kFloat);
  float* op = out.data_ptr<float>();
  parallel_for(0, npanels_, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      dequant_panel(p, 0, static_cast<int>(std::min<int64_t>(kPanel, n() - p * kPanel)), op + p * kPanel * k());
  });
  return out;
}

void QgemmWeight::rows(const int64_t* ids, int64_t t, float* out) const {
  parallel_for(0, t, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int c = static_cast<int>(ids[i] % kPanel);
      dequant_panel(ids[i] / kPanel, c, c + 1, out + i * k());
    }
  });
}

std::string type_list() {
  std::string s;
  for (const qgemm::QType* t = qgemm::all_types(); t->name; ++t)
    s += std::string(s.empty() ? "" : ", ") + t->name + "=" + std::to_string(t->id);
  return s;
}

}  // namespace

std::shared_ptr<PackedWeight> pack_gguf(const at::Tensor& data, int64_t ggml_type, int64_t k) {
  const qgemm::QType* t = qgemm::find_type(static_cast<int>(ggml_type));
  TORCH_CHECK(t, "pack_gguf: ggml type ", ggml_type, " is not supported (", type_list(), ")");
  TORCH_CHECK(data.scalar_type() == at::kByte, "data must be uint8 GGUF blocks, got ", data.scalar_type());
  TORCH_CHECK(data.dim() == 2, "data must be 2-D [N, row_bytes], got ", data.dim(), "-D");
  TORCH_CHECK(data.device().is_cpu(), "data must be on the CPU");
  TORCH_CHECK(k > 0 && k % t->qb == 0, t->name, " needs K a positive multiple of ", t->qb, ", got ", k);
  const int64_t row_bytes = k / t->qb * t->gguf_bytes;
  TORCH_CHECK(data.size(1) == row_bytes, "data has ", data.size(1), " bytes per row; ", t->name, " with K=", k,
              " needs ", row_bytes);
  TORCH_CHECK(data.size(0) > 0, "data has no rows");
  return std::make_shared<QgemmWeight>(*t, data.contiguous(), data.size(0), k);
}

namespace {

void register_qgemm(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("pack_gguf", &pack_gguf, py::arg("data"), py::arg("ggml_type"), py::arg("k"),
        py::call_guard<py::gil_scoped_release>(),
        "PackedWeight of GGUF blocks data (uint8 [N, row_bytes] as stored) of ggml type ggml_type, K values per "
        "row: repacked once into 16-column panels; forward quantizes activations per 32 to int8");
  m.def("pack_gguf_types", [] {
          py::dict out;
          for (const qgemm::QType* t = qgemm::all_types(); t->name; ++t) out[py::str(t->name)] = t->id;
          return out;
        }, "the ggml types pack_gguf takes: {name: ggml type id}");
}

}  // namespace
PDSERVE_REGISTER(register_qgemm);
}  // namespace pdserve
