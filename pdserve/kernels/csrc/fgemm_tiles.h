// Register-tile dispatch shared by the float-weight GEMM kernel files: a kernel K provides
// `template <int MR, int NR> static void run(const Problem&, int64_t r0, int64_t p0)` (MR rows from r0, NR panels
// from p0); walk() covers panels [p0, p1) x all rows with tiles of at most MR x NR. Every output is computed by one
// fixed sequence of operations whatever tile covers it, so the tile sizes are free (speed only).
#pragma once

#include <algorithm>

#include "fgemm_kernels.h"

namespace pdserve::fgemm {

using TileFn = void (*)(const Problem&, int64_t, int64_t);

template <class K, int MAXR, int MAXP>
struct TileTable {
  TileFn fn[MAXR + 1][MAXP + 1] = {};
  constexpr TileTable() { fill<1>(); }
  template <int R>
  constexpr void fill() {
    if constexpr (R <= MAXR) {
      fill_p<R, 1>();
      fill<R + 1>();
    }
  }
  template <int R, int P>
  constexpr void fill_p() {
    if constexpr (P <= MAXP) {
      fn[R][P] = &K::template run<R, P>;
      fill_p<R, P + 1>();
    }
  }
};

// Panels outer (a group of NR panels stays in cache while every row tile passes over it), rows inner.
template <class K, int MR, int NR>
void walk(const Problem& pr, int64_t p0, int64_t p1) {
  static constexpr TileTable<K, MR, NR> table;
  for (int64_t p = p0; p < p1; p += NR) {
    const int np = static_cast<int>(std::min<int64_t>(NR, p1 - p));
    for (int64_t r = 0; r < pr.m; r += MR) table.fn[std::min<int64_t>(MR, pr.m - r)][np](pr, r, p);
  }
}

}  // namespace pdserve::fgemm
