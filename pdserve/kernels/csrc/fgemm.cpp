// Float-weight PackedWeight (packed_weight.h): pack_float(w, "bf16" | "f32") repacks a float32/bfloat16/float16
// matrix W [N, K] once into the panel layout of fgemm_kernels.h; forward() rounds the activations to bf16 (bf16
// format), then splits the panels over ATen's threads (pairs of panels: the AMX kernel's 32-column block).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "parallel.h"
#include "dispatch.h"
#include "fgemm_kernels.h"
#include "packed_weight.h"
#include "registry.h"

namespace pdserve {
namespace fgemm {

void bf16_activations(const Kernels& kn, const float* x, int64_t ldx, int64_t m, int64_t k, int64_t kpad, bool tiles,
                      uint16_t* out) {
  const int64_t nkb = kpad / kKBlock;
  parallel_for(0, (m + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> tmp(tiles ? 16 * kpad : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(16, m - 16 * b);
      uint16_t* dst = tiles ? tmp.data() : out + 16 * b * kpad;
      kn.to_bf16(x + 16 * b * ldx, ldx, 0, rows, k, kpad, dst);
      std::fill(dst + rows * kpad, dst + 16 * kpad, uint16_t{0});
      if (!tiles) continue;
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t c = 0; c < nkb; ++c)
          std::memcpy(out + ((b * nkb + c) * 16 + r) * kKBlock, dst + r * kpad + c * kKBlock, 2 * kKBlock);
    }
  });
}

// L2 budgets of run_blocked (a Sapphire Rapids core's L2: 2 MiB): bf16 activations of a row chunk, a group's bf16
// weights.
constexpr int64_t kRowChunkBytes = 512 << 10, kGroupBytes = 256 << 10;

int64_t row_chunk(int64_t kpad) { return std::max<int64_t>(32, kRowChunkBytes / (2 * kpad) / 32 * 32); }

int64_t panel_group(int64_t kpad) { return std::max<int64_t>(2, kGroupBytes / (kpad * kPanel * 2) / 2 * 2); }

// Row chunks start at multiples of 32 rows: whole 16-row AMX A tiles, whose offset (xb_tiles) is r0 * kpad as in the
// row-major layout (ldx == kpad for bf16 activations).
void run_row_chunks(PanelFn fn, const Problem& pr, int64_t p0, int64_t p1) {
  const int64_t rc = row_chunk(pr.kpad);
  if (pr.m <= rc) return fn(pr, p0, p1);
  for (int64_t r0 = 0; r0 < pr.m; r0 += rc) {
    Problem c = pr;
    c.m = std::min(rc, pr.m - r0);
    c.xb += r0 * pr.ldx;
    c.y += r0 * pr.ldy;
    fn(c, p0, p1);
  }
}

void run_blocked(PanelFn fn, const Problem& pr, int64_t p0, int64_t p1) {
  const int64_t g = panel_group(pr.kpad);
  for (int64_t q = p0; q < p1; q += g) run_row_chunks(fn, pr, q, std::min(q + g, p1));
}

}  // namespace fgemm

namespace {

using fgemm::kKBlock;
using fgemm::kPanel;

const IsaTable<const fgemm::Kernels*>& kernel_table() {
  static const IsaTable<const fgemm::Kernels*> table = {
      {Isa::kGeneric, &fgemm::kGeneric},
      PDSERVE_X86({Isa::kAvx2, &fgemm::kAvx2}, {Isa::kAvx512, &fgemm::kAvx512},
                  {Isa::kAvx512Bf16, &fgemm::kAvx512Bf16}, {Isa::kAmx, &fgemm::kAmx})};
  return table;
}

// Element (r, c) of a contiguous float32/bfloat16/float16 matrix with row length k, as float32 (exact).
float source_at(const at::Tensor& w, int64_t r, int64_t c, int64_t k) {
  const int64_t i = r * k + c;
  switch (w.scalar_type()) {
    case at::kFloat: return w.data_ptr<float>()[i];
    case at::kBFloat16: return bf16_to_fp32(reinterpret_cast<const uint16_t*>(w.data_ptr())[i]);
    default: return fp16_to_fp32(reinterpret_cast<const uint16_t*>(w.data_ptr())[i]);
  }
}

class PackedFloat final : public PackedWeight {
 public:
  PackedFloat(const at::Tensor& w, bool bf16)
      : PackedWeight(w.size(0), w.size(1)), bf16_(bf16),
        kpad_(bf16 ? (w.size(1) + kKBlock - 1) / kKBlock * kKBlock : w.size(1)) {
    const int64_t np = panels(), n = w.size(0), k = w.size(1);
    data_ = at::zeros({np * kPanel * kpad_ * (bf16 ? 2 : 4)}, at::kByte);
    parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j)
          for (int64_t c = 0; c < k; ++c) {
            const float v = source_at(w, p * kPanel + j, c, k);
            if (bf16_) bf16_data()[slot(p * kPanel + j, c)] = fgemm::to_bf16_flush(v);
            else f32_data()[slot(p * kPanel + j, c)] = v;
          }
    });
  }

  std::string type_name() const override { return bf16_ ? "BF16" : "F32"; }
  int64_t nbytes() const override { return data_.numel(); }

  void forward(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias) const override {
    const fgemm::Kernels& kn = *kernel_table().pick();
    fgemm::Problem pr{data_.data_ptr(), kpad_, n(), x, nullptr, ldx, false, m, y, ldy, bias};
    thread_local std::vector<uint16_t> scratch;  // the calling thread's: workers get its pointer, not their own
    if (bf16_) {
      pr.xb_tiles = kn.tiles && m >= fgemm::amx_min_rows();
      const int64_t size = (m + 15) / 16 * 16 * kpad_;  // rows padded to 16: the AMX kernel loads 16-row tiles
      if (static_cast<int64_t>(scratch.size()) < size) scratch.resize(size);
      fgemm::bf16_activations(kn, x, ldx, m, k(), kpad_, pr.xb_tiles, scratch.data());
      pr.xb = scratch.data();
      pr.ldx = kpad_;
    }
    const fgemm::PanelFn fn = bf16_ ? kn.bf16 : kn.f32;
    const int64_t np = panels(), pairs = (np + 1) / 2;
    const int64_t grain = std::max<int64_t>(1, (pairs + num_threads() - 1) / num_threads());
    parallel_for(0, pairs, grain, [&](int64_t a, int64_t b) {
      // AMX tiles in cache blocks; the FMA kernels keep one call per thread (blocked, the f32 format's 1.7B gate_up
      // ran 1.2x slower on Sapphire Rapids' avx512 level)
      if (pr.xb_tiles) fgemm::run_blocked(fn, pr, 2 * a, std::min(2 * b, np));
      else fn(pr, 2 * a, std::min(2 * b, np));
    });
  }

  at::Tensor dequantize() const override {
    at::Tensor out = at::empty({n(), k()}, at::kFloat);
    std::vector<int64_t> ids(n());
    for (int64_t i = 0; i < n(); ++i) ids[i] = i;
    rows(ids.data(), n(), out.data_ptr<float>());
    return out;
  }

  void rows(const int64_t* ids, int64_t t, float* out) const override {
    parallel_for(0, t, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t c = 0; c < k(); ++c)
          out[i * k() + c] = bf16_ ? bf16_to_fp32(bf16_data()[slot(ids[i], c)]) : f32_data()[slot(ids[i], c)];
    });
  }

 private:
  int64_t panels() const { return (n() + kPanel - 1) / kPanel; }
  // Index of W[r, c] in the packed data (in elements of the stored type).
  int64_t slot(int64_t r, int64_t c) const {
    const int64_t p = r / kPanel, j = r % kPanel;
    if (!bf16_) return (p * kpad_ + c) * kPanel + j;
    return p * kpad_ * kPanel + (c / 2) * 2 * kPanel + 2 * j + (c % 2);
  }
  uint16_t* bf16_data() const { return reinterpret_cast<uint16_t*>(data_.data_ptr()); }
  float* f32_data() const { return reinterpret_cast<float*>(data_.data_ptr()); }

  bool bf16_;
  int64_t kpad_;
  at::Tensor data_;  // the panels, uint8 storage (64-byte aligned by ATen's allocator)
};

std::shared_ptr<PackedWeight> pack_float(const at::Tensor& w, const std::string& fmt) {
  TORCH_CHECK(fmt == "bf16" || fmt == "f32", "fmt must be 'bf16' or 'f32', got '", fmt, "'");
  TORCH_CHECK(w.dim() == 2, "w must be 2-D [N, K], got ", w.dim(), "-D");
  TORCH_CHECK(w.device().is_cpu(), "w must be on the CPU");
  const auto st = w.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "w must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK(w.size(0) > 0 && w.size(1) > 0, "w must not be empty, got ", w.sizes());
  return std::make_shared<PackedFloat>(w.contiguous(), fmt == "bf16");
}

void register_fgemm(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("pack_float", &pack_float, py::arg("w"), py::arg("fmt"), py::call_guard<py::gil_scoped_release>(),
        "PackedWeight of a float32/bfloat16/float16 W [N, K] stored as 'bf16' (activations rounded to bf16 per "
        "call; AMX / vdpbf16ps / FMA by ISA level) or 'f32' (exact weights, fp32 FMA)");
  m.def("fgemm_bf16_order", [] { return std::string(kernel_table().pick()->bf16_order); },
        "the bf16 accumulation order of the active level: 'block' (AMX's) or 'pair' (vdpbf16ps's)");
  m.def("fgemm_amx_min_rows", &fgemm::amx_min_rows, "rows from which the amx level multiplies with AMX tiles");
  m.def("set_fgemm_amx_min_rows", [](int64_t rows) {
          TORCH_CHECK(rows >= 1, "rows must be >= 1");
          fgemm::set_amx_min_rows(rows);
        }, py::arg("rows"), "change that threshold (tests, benchmarks; the result bits do not depend on it)");
}

}  // namespace
PDSERVE_REGISTER(register_fgemm);
}  // namespace pdserve
