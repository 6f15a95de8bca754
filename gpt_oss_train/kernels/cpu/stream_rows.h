// Products of a few rows with a large float32 or bfloat16 matrix, at memory bandwidth:
// the shared inner loops of the CPU kernels (moe_decode.cc, rows_matmul.cc). Activations
// and accumulation are float32; bfloat16 weights are widened in registers (exact: a
// bfloat16 is the high half of a float32), so they cost half the memory traffic of float32
// ones on any CPU, with or without bfloat16 arithmetic units.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace gpt_oss_cpu {

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t bf16;  // a bfloat16's bits (XLA FFI's BF16 element type)
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

constexpr int kRowBlock = 4;   // rows sharing one pass over the weights
constexpr int kDepthStep = 8;  // weight rows swept together (even)

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline v8f load8(const bf16* p) {
#ifdef __AVX2__
  // One zero-extending load and a shift (GCC splits the generic form below into four
  // shuffles, which made the bfloat16 sweep slower than float32's).
  const __m256i wide = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return v8f(_mm256_castsi256_ps(wide));
#else
  v8h h;
  __builtin_memcpy(&h, p, sizeof(h));
  const v8u wide = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  __builtin_memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}

inline float widen(float x) { return x; }

inline float widen(bf16 x) {
  const uint32_t bits = uint32_t(x) << 16;
  float v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// A weight buffer of float32 or bfloat16 elements (the element type decided at run time,
// by the custom call's operand); offsets count elements.
struct Weights {
  const void* data = nullptr;
  bool bf16 = false;
  template <class T>
  const T* at(int64_t offset) const {
    return static_cast<const T*>(data) + offset;
  }
  // The same buffer from element `offset` on (a layer of a stack).
  Weights from(int64_t offset) const {
    return {bf16 ? static_cast<const void*>(at<uint16_t>(offset)) : at<float>(offset), bf16};
  }
};

// Reads an FFI operand as Weights: F32, BF16, or U16 holding bfloat16 bit patterns (how
// the KV cache stores bfloat16, arrays/bit_moves.py); false for other element types.
inline bool as_weights(xla::ffi::AnyBuffer buffer, Weights* w) {
  using xla::ffi::DataType;
  const DataType t = buffer.element_type();
  if (t != DataType::F32 && t != DataType::BF16 && t != DataType::U16) return false;
  w->data = buffer.untyped_data();
  w->bf16 = t != DataType::F32;
  return true;
}

// out[r, :n] += sum_{i < kDepthStep} rows[r][d + i] * w[(d + i) * ldw + :n] for NR rows:
// kDepthStep weight rows swept together across the columns, so memory sees a few
// sequential streams and each output vector is loaded and stored once per kDepthStep
// weight rows (a 2-core Zen 3 reads at its full bandwidth this way; two weight rows per
// sweep reached 65%).
template <int NR, class W>
inline void sweep(const float* const* rows, int d, const W* w, int64_t ldw, int n,
                  float* out, int64_t ldo) {
  constexpr int S = kDepthStep;
  const W* w0 = w + d * ldw;
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
    // The next sweep's weights, one prefetch a cache line, into L2. The S rows' streams
    // interleave within each 4 KB page, which the hardware prefetchers do not follow when
    // rows are short (an expert's 768 columns): without this a core waited on each load,
    // and bfloat16 weights streamed no faster than float32 ones (docs/PERFORMANCE.md).
    if ((c * sizeof(W)) % 64 == 0)
      for (int i = 0; i < S; ++i) __builtin_prefetch(w0 + (S + i) * ldw + c, 0, 1);
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
      for (int i = 0; i < S; ++i) out[r * ldo + c] += xs[i][r] * widen(w0[i * ldw + c]);
}

// out[r, :n] = sum_d rows[r][d] * w[d * ldw + :n], for r < nrows. Depth outside, rows
// inside: each kDepthStep x n slice of the weights is read from memory once and stays in
// L1 while every row block (kRowBlock rows) sweeps it, so many rows cost arithmetic, not
// re-reads of the weights (callers keep n small enough for the rows' outputs to stay in
// L1/L2).
template <class W>
inline void matmul_rows(const float* const* rows, int nrows, const W* w, int64_t ldw,
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
      for (int c = 0; c < n; ++c) out[r * ldo + c] += rows[r][d] * widen(w[d * ldw + c]);
}

// matmul_rows over the matrix at element `offset` of `w`, of either element type.
inline void matmul_rows(const float* const* rows, int nrows, const Weights& w, int64_t offset,
                        int64_t ldw, int depth, int n, float* out, int64_t ldo) {
  if (w.bf16)
    matmul_rows(rows, nrows, w.at<bf16>(offset), ldw, depth, n, out, ldo);
  else
    matmul_rows(rows, nrows, w.at<float>(offset), ldw, depth, n, out, ldo);
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

// run(i) for each i < items, once, on the calling thread and the pool's threads (run_on_pool
// with one shared counter); returns when every item is done. `run` is copied to the
// helpers, so it must hold what it reads by value or shared_ptr.
template <class Run>
void run_items(xla::ffi::ThreadPool& pool, int items, Run run) {
  struct Counter {
    std::atomic<int> next{0}, done{0};
  };
  auto count = std::make_shared<Counter>();
  run_on_pool(pool, [count, items, run] {
    for (int i; (i = count->next.fetch_add(1)) < items;) {
      run(i);
      count->done.fetch_add(1, std::memory_order_release);
    }
  }, [&] { return count->done.load(std::memory_order_acquire) >= items; });
}

// row(r) for each r < rows, `per_item` consecutive rows an item (run_items). `row` is
// copied to the helpers, as run_items' `run`.
template <class Row>
void run_rows(xla::ffi::ThreadPool& pool, int64_t rows, int per_item, Row row) {
  const int items = int((rows + per_item - 1) / per_item);
  run_items(pool, items, [rows, per_item, row](int i) {
    for (int64_t r = int64_t(i) * per_item; r < std::min(rows, int64_t(i + 1) * per_item); ++r) row(r);
  });
}

}  // namespace gpt_oss_cpu
