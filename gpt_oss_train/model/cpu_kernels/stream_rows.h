// Products of a few rows with a large float32 matrix, at memory bandwidth: the shared
// inner loops of the CPU kernels (moe_decode.cc, rows_matmul.cc).

#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace gpt_oss_cpu {

typedef float v8f __attribute__((vector_size(32)));

constexpr int kRowBlock = 4;   // rows sharing one pass over the weights
constexpr int kDepthStep = 8;  // weight rows swept together (even)

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// out[r, :n] += sum_{i < kDepthStep} rows[r][d + i] * w[(d + i) * ldw + :n] for NR rows:
// kDepthStep weight rows swept together across the columns, so memory sees a few
// sequential streams and each output vector is loaded and stored once per kDepthStep
// weight rows (a 2-core Zen 3 reads at its full bandwidth this way; two weight rows per
// sweep reached 65%).
template <int NR>
inline void sweep(const float* const* rows, int d, const float* w, int64_t ldw, int n,
                  float* out, int64_t ldo) {
  constexpr int S = kDepthStep;
  const float* w0 = w + d * ldw;
  float xs[S][NR];
  for (int i = 0; i < S; ++i)
    for (int r = 0; r < NR; ++r) xs[i][r] = rows[r][d + i];
  int c = 0;
  // 16 columns at a time: 2 x NR accumulators in registers across the kDepthStep weight
  // rows, so each broadcast x feeds two FMAs and loads stay below the FMA rate.
  for (; c + 16 <= n; c += 16) {
    v8f lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      lo[r] = load8(out + r * ldo + c);
      hi[r] = load8(out + r * ldo + c + 8);
    }
    for (int i = 0; i < S; ++i) {
      const v8f wl = load8(w0 + i * ldw + c), wh = load8(w0 + i * ldw + c + 8);
      for (int r = 0; r < NR; ++r) {
        lo[r] += xs[i][r] * wl;
        hi[r] += xs[i][r] * wh;
      }
    }
    for (int r = 0; r < NR; ++r) {
      store8(out + r * ldo + c, lo[r]);
      store8(out + r * ldo + c + 8, hi[r]);
    }
  }
  for (; c < n; ++c)
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < S; ++i) out[r * ldo + c] += xs[i][r] * w0[i * ldw + c];
}

// out[r, :n] = sum_d rows[r][d] * w[d * ldw + :n], for r < nrows. Depth outside, rows
// inside: each kDepthStep x n slice of the weights is read from memory once and stays in
// L1 while every row block (kRowBlock rows) sweeps it, so many rows cost arithmetic, not
// re-reads of the weights (callers keep n small enough for the rows' outputs to stay in
// L1/L2).
inline void matmul_rows(const float* const* rows, int nrows, const float* w, int64_t ldw,
                        int depth, int n, float* out, int64_t ldo) {
  for (int r = 0; r < nrows; ++r) std::fill(out + r * ldo, out + r * ldo + n, 0.0f);
  int d = 0;
  for (; d + kDepthStep <= depth; d += kDepthStep) {
    for (int r0 = 0; r0 < nrows; r0 += kRowBlock) {
      const float* const* rr = rows + r0;
      float* o = out + r0 * ldo;
      switch (std::min(kRowBlock, nrows - r0)) {
        case 1: sweep<1>(rr, d, w, ldw, n, o, ldo); break;
        case 2: sweep<2>(rr, d, w, ldw, n, o, ldo); break;
        case 3: sweep<3>(rr, d, w, ldw, n, o, ldo); break;
        default: sweep<4>(rr, d, w, ldw, n, o, ldo); break;
      }
    }
  }
  for (; d < depth; ++d)  // the last depth % kDepthStep weight rows
    for (int r = 0; r < nrows; ++r)
      for (int c = 0; c < n; ++c) out[r * ldo + c] += rows[r][d] * w[d * ldw + c];
}

// Runs `work` on the calling thread and on every other thread of XLA's intra-op pool, and
// returns once `finished()`. `work` claims items from shared atomic counters until none is
// left, so a helper the busy pool starts late finds nothing to do (it must hold the shared
// state by shared_ptr: it may run after the call returned).
template <class Work, class Finished>
void run_on_pool(xla::ffi::ThreadPool& pool, Work work, Finished finished) {
  const int helpers = std::max(0, int(pool.num_threads()) - 1);
  for (int i = 0; i < helpers; ++i) pool.Schedule(Work(work));
  work();
  while (!finished()) std::this_thread::yield();
}

}  // namespace gpt_oss_cpu
