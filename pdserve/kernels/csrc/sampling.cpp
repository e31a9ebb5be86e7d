// The random rows' token draw: temperature, top-k, top-p (nucleus) and min-p, then one inverse-CDF draw per row,
// each row in one pass family over its logits (the kernels' threads split the rows).
//
// The kept set is the definition's (vLLM's and the PyTorch path's, model/sampler.py): top-k keeps the k most
// probable tokens; top-p keeps the smallest most-probable-first prefix of the (top-k) distribution whose mass reaches
// top_p (a token stays while the mass before it is below top_p, so the best token always stays); min-p keeps tokens
// whose probability is at least min_p times the best one's. The draw is the PyTorch path's: the first token, in
// vocabulary order, whose cumulative kept mass exceeds u times the total (u uniform in [0, 1), one per row, drawn by
// the caller so a seeded request keeps its own generator).
//
// No sort of the vocabulary: with e = exp(x / T - max) <= 1 per token (written once), a histogram of e by the top
// bits of its float (exponent and 5 mantissa bits: bins ~3 % wide, most probable last) gives each bin's count and
// mass; walking the bins from the top finds the one bin where the top-k count or the top-p mass is reached, and
// only that bin's tokens are gathered and ordered. Cost per row: a max pass, an exp pass, the histogram and a
// cumulative pass, each over the row in L2 (the PyTorch path took a partial top-k and a sort per row).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "parallel.h"
#include "registry.h"
#include "sampling_kernels.h"

namespace pdserve {
namespace {

float row_max_generic(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > m) m = x[i];
  return m;
}

float exp_row_generic(const float* x, int64_t n, float s, float m, float* e) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] * s - m;
    e[i] = d >= kMinExpArg ? std::exp(d) : 0.f;  // false for NaN
    total += e[i];
  }
  return total;
}

constexpr int kBinShift = 18;                           // keep the exponent and 5 mantissa bits
constexpr int kBins = (0x3F800000 >> kBinShift) + 1;  // e in [0, 1]; bin 0 holds the zeros only (no subnormals)

inline uint32_t bin_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b >> kBinShift;
}

struct RowParams {
  float temperature;
  int64_t top_k;   // <= 0 or >= vocabulary: off
  float top_p;     // 1: off
  float min_p;     // 0: off
};

struct Scratch {
  std::vector<float> e;
  std::vector<uint32_t> count;
  std::vector<double> mass;
  std::vector<std::pair<float, int32_t>> bin;  // one bin's tokens: (e, index)
  std::vector<float> sums;                      // draw's block sums
};

// Most probable first; ties by index (the order does not matter for the distribution, but it is fixed).
inline bool before(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

void gather_bin(const float* e, int64_t n, uint32_t b, Scratch& s) {
  s.bin.clear();
  for (int64_t i = 0; i < n; ++i)
    if (bin_of(e[i]) == b) s.bin.emplace_back(e[i], static_cast<int32_t>(i));
}

// Keeps the best r tokens of bin b (b > 0), zeroing the others' e; returns their mass.
double keep_best_of_bin(float* e, int64_t n, uint32_t b, int64_t r, Scratch& s) {
  gather_bin(e, n, b, s);
  if (r < static_cast<int64_t>(s.bin.size())) {
    std::nth_element(s.bin.begin(), s.bin.begin() + r, s.bin.end(), before);
    for (size_t j = r; j < s.bin.size(); ++j) e[s.bin[j].second] = 0.f;
    s.bin.resize(r);
  }
  double m = 0;
  for (const auto& t : s.bin) m += t.first;
  return m;
}

// Bin b holds where the kept mass reaches `target` (the mass of the bins above is `cum`): keeps its tokens, most
// probable first, while the mass before each is below target, zeroing the others' e.
void keep_nucleus_of_bin(float* e, int64_t n, uint32_t b, double cum, double target, Scratch& s) {
  gather_bin(e, n, b, s);
  std::sort(s.bin.begin(), s.bin.end(), before);
  for (const auto& t : s.bin) {
    if (cum >= target) e[t.second] = 0.f;
    cum += t.first;
  }
}

// What stays of a row: tokens with bin_of(e) >= first_bin and e >= min_e (e > 0 for a token to be drawn).
struct Kept {
  uint32_t first_bin;
  float min_e;
};

// Writes s.e (the row's exp(x / T - max), zeroed for the tokens the boundary bins drop) and returns the rule.
Kept filter_row(const SamplingKernels& k, const float* x, int64_t n, const RowParams& p, Scratch& s) {
  const float inv_t = 1.f / p.temperature;
  const float mx = k.row_max(x, n);
  TORCH_CHECK(mx > -INFINITY && std::isfinite(mx * inv_t), "a row has no finite logit to sample from");
  s.e.resize(n);
  float* e = s.e.data();
  k.exp_row(x, n, inv_t, mx * inv_t, e);  // the best token: exactly 1 (x * s - m with m = mx * s)
  Kept kept{0, p.min_p > 0.f ? p.min_p : 0.f};  // min-p: p_i >= min_p * p_max, and p_max's e is 1
  const bool use_k = p.top_k > 0 && p.top_k < n, use_p = p.top_p < 1.f;
  if (!use_k && !use_p) return kept;
  s.count.assign(kBins, 0);
  s.mass.assign(kBins, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bin_of(e[i]);
    ++s.count[b];
    s.mass[b] += e[i];
  }
  int bk = 0;  // the top-k boundary bin: the bins above it and its best tokens are the top-k set
  double total = 0;
  if (use_k) {
    int64_t above = 0;
    for (bk = kBins - 1; bk > 0 && above + s.count[bk] < p.top_k; --bk) above += s.count[bk], total += s.mass[bk];
    if (bk > 0) {
      s.mass[bk] = keep_best_of_bin(e, n, bk, p.top_k - above, s);
      total += s.mass[bk];
    }  // bk == 0: the set reaches into zero-probability tokens, which are never drawn
  } else {
    for (int b = kBins - 1; b > 0; --b) total += s.mass[b];
  }
  kept.first_bin = bk;
  if (use_p) {  // normalised over the top-k set, or the whole row without one
    const double target = static_cast<double>(p.top_p) * total;
    double cum = 0;
    for (int b = kBins - 1; b >= std::max(bk, 1); --b) {
      if (cum + s.mass[b] >= target) {
        keep_nucleus_of_bin(e, n, b, cum, target, s);
        kept.first_bin = b;
        break;
      }
      cum += s.mass[b];
    }  // not reached (rounding of the bins' sums): the top-k set or the whole row stays
  }
  return kept;
}

inline bool keeps(const Kept& k, float v) { return bin_of(v) >= k.first_bin && v >= k.min_e; }

// Kept mass of e[i0, i1) (the loop vectorises: omp simd may reassociate the sum).
inline float kept_sum(const float* e, int64_t i0, int64_t i1, const Kept& k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = i0; i < i1; ++i) s += keeps(k, e[i]) ? e[i] : 0.f;
  return s;
}

// The first token whose cumulative kept mass (vocabulary order) exceeds u * total. Blocks of kBlock tokens: the
// blocks' sums find the block, a scan within it the token.
int64_t draw(const float* e, int64_t n, const Kept& k, float u, std::vector<float>& sums) {
  constexpr int64_t kBlock = 256;
  const int64_t nb = (n + kBlock - 1) / kBlock;
  sums.resize(nb);
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) total += sums[b] = kept_sum(e, b * kBlock, std::min(n, (b + 1) * kBlock), k);
  const float target = u * total;
  float c = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    if (!(c + sums[b] > target)) {
      c += sums[b];
      continue;
    }
    for (int64_t i = b * kBlock, end = std::min(n, (b + 1) * kBlock); i < end; ++i) {
      if (!keeps(k, e[i]) || e[i] == 0.f) continue;
      c += e[i];
      if (c > target) return i;
    }  // the block's scan fell short of its sum (rounding): on to the next
  }
  for (int64_t i = n - 1; i > 0; --i)  // u * total rounded up to the total: the last kept token
    if (keeps(k, e[i]) && e[i] > 0.f) return i;
  return 0;
}

struct Rows {
  const float* x;
  int64_t ld, n;
  const float *temperature, *top_p, *min_p;
  const int64_t* top_k;
};

Rows check_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                const at::Tensor& top_p, const at::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "logits must be a 2-D float32 CPU tensor, got ", logits.sizes(), " ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31) && logits.stride(1) == 1,
              "logits must have 1 .. 2^31 - 1 columns, contiguous");
  const int64_t b = logits.size(0);
  for (const auto& [t, name, type] : {std::tuple{&temperature, "temperature", at::kFloat},
                                      std::tuple{&top_k, "top_k", at::kLong}, std::tuple{&top_p, "top_p", at::kFloat},
                                      std::tuple{&min_p, "min_p", at::kFloat}})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == b && t->scalar_type() == type && t->is_contiguous() &&
                t->device().is_cpu(), name, " must be a contiguous CPU ", at::toString(type), " tensor of ", b,
                " values (one per row)");
  const float *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(tp[r] > 0.f && std::isfinite(tp[r]), "temperature must be > 0 for a random row, got ", tp[r]);
    TORCH_CHECK(pp[r] > 0.f && pp[r] <= 1.f, "top_p must be in (0, 1], got ", pp[r]);
    TORCH_CHECK(mp[r] >= 0.f && mp[r] <= 1.f, "min_p must be in [0, 1], got ", mp[r]);
  }
  return {logits.data_ptr<float>(), logits.stride(0), logits.size(1), tp, pp, mp, top_k.data_ptr<int64_t>()};
}

const SamplingKernels& kernels() {
  static const IsaTable<const SamplingKernels& (*)()> table = {
      {Isa::kGeneric, sampling_kernels_generic},
      PDSERVE_X86({Isa::kAvx2, sampling_kernels_avx2}, {Isa::kAvx512, sampling_kernels_avx512})};
  return table.pick()();
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  const Rows rows = check_rows(logits, temperature, top_k, top_p, min_p);
  const int64_t b = logits.size(0);
  TORCH_CHECK(u.dim() == 1 && u.size(0) == b && u.scalar_type() == at::kFloat && u.is_contiguous(),
              "u must be a contiguous float32 tensor of ", b, " values");
  const float* up = u.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) TORCH_CHECK(up[r] >= 0.f && up[r] < 1.f, "u must be in [0, 1), got ", up[r]);
  at::Tensor out = at::empty({b}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const SamplingKernels& k = kernels();
  parallel_for(0, b, 1, [&](int64_t r0, int64_t r1) {
    thread_local Scratch s;
    for (int64_t r = r0; r < r1; ++r) {
      const RowParams p{rows.temperature[r], rows.top_k[r], rows.top_p[r], rows.min_p[r]};
      const Kept kept = filter_row(k, rows.x + r * rows.ld, rows.n, p, s);
      o[r] = draw(s.e.data(), rows.n, kept, up[r], s.sums);
    }
  });
  return out;
}

at::Tensor sampling_kept(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                         const at::Tensor& top_p, const at::Tensor& min_p) {
  const Rows rows = check_rows(logits, temperature, top_k, top_p, min_p);
  at::Tensor out = at::zeros({logits.size(0), rows.n}, at::kBool);
  bool* o = out.data_ptr<bool>();
  const SamplingKernels& k = kernels();
  parallel_for(0, logits.size(0), 1, [&](int64_t r0, int64_t r1) {
    thread_local Scratch s;
    for (int64_t r = r0; r < r1; ++r) {
      const RowParams p{rows.temperature[r], rows.top_k[r], rows.top_p[r], rows.min_p[r]};
      const Kept kept = filter_row(k, rows.x + r * rows.ld, rows.n, p, s);
      for (int64_t i = 0; i < rows.n; ++i) o[r * rows.n + i] = s.e[i] > 0.f && keeps(kept, s.e[i]);
    }
  });
  return out;
}

void register_sampling(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("sample_rows", &sample_rows, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("min_p"), py::arg("u"), py::call_guard<py::gil_scoped_release>(),
        "one token per row from softmax(logits / temperature) after top-k (<= 0: off), top-p (1: off) and min-p "
        "(0: off): the first token whose cumulative kept probability exceeds u (int64 [rows])");
  m.def("sampling_kept", &sampling_kept, py::arg("logits"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::call_guard<py::gil_scoped_release>(),
        "bool [rows, vocab]: the tokens sample_rows may draw (kept by top-k, top-p and min-p, probability > 0)");
}

PDSERVE_REGISTER(register_sampling);

}  // namespace

const SamplingKernels& sampling_kernels_generic() {
  static const SamplingKernels k{row_max_generic, exp_row_generic};
  return k;
}

}  // namespace pdserve
