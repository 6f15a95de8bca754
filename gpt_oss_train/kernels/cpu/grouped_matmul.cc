// The grouped matmul and its two backward products on CPUs with bfloat16 dot-product
// instructions (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and
// later), as XLA FFI custom calls. Rows are grouped contiguously: the first sizes[0] rows
// of x use w[0], the next sizes[1] rows w[1], ...
//
//   GptOssGroupedMatmul, transpose = 0:  y = x @ w[layer, g]     x [M, K], w [L, G, K, N]
//   GptOssGroupedMatmul, transpose = 1:  y = x @ w[layer, g]^T   x [M, N], w [L, G, K, N]
//   GptOssGroupedMatmulWeightGrad:       dw[g] = x_g^T @ dy_g    x [M, K], dy [M, N]
//
// x is bfloat16 (or its uint16 bits); w and dy float32 or bfloat16, rounded to bfloat16
// (to nearest even, as XLA's convert) as they are packed; sums and results are float32.
// Rows of y past sum(sizes) are zeros, and so is dw[g] of a group without rows.
//
// Why kernels: XLA:CPU's tile loop around per-group dots costs masks, copies and updates
// per tile, copies each group's matrix out of the stack first, and runs the transposed
// products of the backward as float32 dots after converting their operands
// (docs/PERFORMANCE.md). Here `vdpbf16ps` multiplies pairs of bfloat16 values into
// float32 sums at twice the FMA rate, and every operand is read in place.
//
// The instruction wants both operands as pairs along the contraction: one 32-bit lane
// holds (a[2p], a[2p + 1]). A row of x already is such pairs; the other operand is packed,
// a panel of kPanel output columns at a time (kept in L2), with consecutive contraction
// rows interleaved. A register block of kRows rows x kPanel columns then sweeps the
// contraction (rows_by_panel). Work items, claimed by the threads of XLA's intra-op pool
// from a shared counter, are (group, panel); consecutive items share a group, so its rows
// stay in L2 across its panels.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <immintrin.h>

#include "stream_rows.h"
#include "xla/ffi/api/ffi.h"

// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU): a
// failed build leaves the registry on the tiled reference (xla/grouped_matmul.py).
#ifndef __AVX512BF16__
#error "grouped_matmul.cc needs AVX512-BF16 (vdpbf16ps)"
#endif

namespace ffi = xla::ffi;

namespace {

using gpt_oss_cpu::bf16;

// Groups with rows: each one's index, first row and row count.
struct Groups {
  std::vector<int> index, first, size;
  int rows = 0;  // sum of the sizes (at most the operand's rows)
  Groups(const int32_t* sizes, int count, int max_rows) {
    for (int g = 0; g < count; ++g) {
      const int n = std::clamp(sizes[g], 0, max_rows - rows);  // never past x's rows
      if (n > 0) {
        index.push_back(g);
        first.push_back(rows);
        size.push_back(n);
      }
      rows += n;
    }
  }
  int used() const { return int(index.size()); }
};

constexpr int kPanel = 64;  // columns per packed panel: four vectors of 16 float32 sums
constexpr int kRows = 6;    // rows per register block: 24 accumulators of 32 registers
constexpr int kAhead = 16;  // rows of a matrix prefetched ahead of its packing

__mmask16 first_bits(int n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : __mmask16((1u << n) - 1); }

// A float32 or bfloat16 matrix: element (r, c) at element r * ld + c of `w`.
struct Matrix {
  gpt_oss_cpu::Weights w;
  int64_t ld;
  bool f32() const { return !w.bf16; }
  const float* f(int64_t r, int64_t c) const { return w.at<float>(r * ld + c); }
  const bf16* h(int64_t r, int64_t c) const { return w.at<bf16>(r * ld + c); }
};

// (low 16 bfloat16 values, high 16) -> 16 pairs (low[i], high[i]).
__m512i interleave(__m512i v) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), v);
}

// 16 pairs (m[r][c + i], m[r + 1][c + i]) as bfloat16, i < n (zeros from n on; the second
// row zeros where `second` is false: an odd row count's last pair).
__m512i row_pairs(const Matrix& m, int64_t r, bool second, int64_t c, int n) {
  const __mmask16 k0 = first_bits(n), k1 = second ? k0 : 0;  // masked loads never fault
  if (m.f32())
    return interleave(__m512i(_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(k1, m.f(r + 1, c)),
                                                  _mm512_maskz_loadu_ps(k0, m.f(r, c)))));
  const __m256i lo = _mm256_maskz_loadu_epi16(k0, m.h(r, c));
  const __m256i hi = _mm256_maskz_loadu_epi16(k1, m.h(r + 1, c));
  return interleave(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

// panel[p][j] = (m[r0 + 2p][c0 + j], m[r0 + 2p + 1][c0 + j]) for j < kPanel (zeros from
// `cols` on), p < ceil(rows / 2), each p a run of 2 * kPanel bfloat16 values.
void pack_rows(const Matrix& m, int64_t r0, int rows, int64_t c0, int cols, bf16* panel) {
  for (int p = 0; 2 * p < rows; ++p) {
    const int64_t r = r0 + 2 * p;
    // Rows kAhead ahead, into L2: a panel reads 128-256 bytes of each row, too short a
    // run for the hardware prefetchers to follow.
    if (2 * p + kAhead + 1 < rows)
      for (int i = 0; i < 2; ++i) {
        const char* ahead = m.f32() ? reinterpret_cast<const char*>(m.f(r + kAhead + i, c0))
                                    : reinterpret_cast<const char*>(m.h(r + kAhead + i, c0));
        for (int j = 0; j < cols * (m.f32() ? 4 : 2); j += 64) __builtin_prefetch(ahead + j, 0, 1);
      }
    for (int j = 0; j < kPanel; j += 16)
      _mm512_storeu_si512(panel + int64_t(p) * 2 * kPanel + 2 * j,
                          row_pairs(m, r, 2 * p + 1 < rows, c0 + j, cols - j));
  }
}

// panel[p][j] = (m[r0 + j][2p], m[r0 + j][2p + 1]) for j < kPanel (zeros from `cols`
// on), p < depth / 2: the panel of m^T, gathered along m's rows.
void pack_columns(const Matrix& m, int64_t r0, int cols, int depth, bf16* panel) {
  for (int j = 0; j < kPanel; j += 16) {
    const __mmask16 k = first_bits(cols - j);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_epi32(int(m.ld)));
    for (int p = 0; p < depth / 2; ++p) {
      __m512i v;
      if (m.f32()) {
        const float* at = m.f(r0, 2 * p);
        const __m512 even = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, rows, at, 4);
        const __m512 odd = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, rows, at + 1, 4);
        v = interleave(__m512i(_mm512_cvtne2ps_pbh(odd, even)));
      } else {  // a pair is one 32-bit word: m.ld is even, so rows * 2 bytes stay aligned
        v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, rows, m.h(r0, 2 * p), 2);
      }
      _mm512_storeu_si512(panel + int64_t(p) * 2 * kPanel + 2 * j, v);
    }
  }
}

// y[r, :cols] = sum_p a(r, p) * b(p, :) for R rows (cols <= kPanel), where a(r, p) is the
// pair at a + r * a_row + p * a_pair and b(p, :) the kPanel pairs at b + p * b_pair (all
// kPanel of them are read, whatever `cols` is: they must lie inside the caller's buffer).
// `stream`: full, aligned rows of y go straight to memory (non-temporal stores), not
// through the caches: for an output as large as a float32 weight gradient (75 MB at 32
// experts of 768 x 768, 1 GB at gpt-oss-20b's), this skips reading each line before
// writing it (docs/PERFORMANCE.md, "CPU kernels"). The products' outputs gained nothing
// from it.
template <int R>
void rows_by_panel(const bf16* a, int64_t a_row, int64_t a_pair, const bf16* b,
                   int64_t b_pair, int pairs, float* y, int64_t ldy, int cols, bool stream) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    __m512bh bq[4];
    for (int q = 0; q < 4; ++q) bq[q] = __m512bh(_mm512_loadu_si512(b + p * b_pair + 32 * q));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * a_row + p * a_pair, sizeof(pair));
      const __m512bh ar = __m512bh(_mm512_set1_epi32(pair));
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], ar, bq[q]);
    }
  }
  if (stream && cols == kPanel && ((reinterpret_cast<uintptr_t>(y) | (ldy * 4)) & 63) == 0) {
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) _mm512_stream_ps(y + r * ldy + 16 * q, acc[r][q]);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * q, first_bits(cols - 16 * q), acc[r][q]);
}

// rows_by_panel over `rows` rows, kRows at a time.
void block_by_panel(const bf16* a, int64_t a_row, int64_t a_pair, int rows, const bf16* b,
                    int64_t b_pair, int pairs, float* y, int64_t ldy, int cols, bool stream = false) {
  for (int r = 0; r < rows; r += kRows) {
    const bf16* ar = a + r * a_row;
    float* yr = y + r * ldy;
#define GPT_OSS_ROWS(R) rows_by_panel<R>(ar, a_row, a_pair, b, b_pair, pairs, yr, ldy, cols, stream)
    switch (std::min(kRows, rows - r)) {
      case 1: GPT_OSS_ROWS(1); break;
      case 2: GPT_OSS_ROWS(2); break;
      case 3: GPT_OSS_ROWS(3); break;
      case 4: GPT_OSS_ROWS(4); break;
      case 5: GPT_OSS_ROWS(5); break;
      default: GPT_OSS_ROWS(kRows); break;
    }
#undef GPT_OSS_ROWS
  }
}

// Items claimed from a counter by every thread of the pool; `phases` runs in order, each
// waiting for the previous one's items to finish.
struct Phased {
  static constexpr int kMax = 2;
  int phases = 1, items[kMax] = {};
  std::atomic<int> next[kMax] = {}, done[kMax] = {};
  bool finished() const { return done[phases - 1].load(std::memory_order_acquire) >= items[phases - 1]; }
  template <class Run>
  void work(Run run) {
    for (int phase = 0; phase < phases; ++phase) {
      if (phase > 0)
        while (done[phase - 1].load(std::memory_order_acquire) < items[phase - 1])
          std::this_thread::yield();
      for (int i; (i = next[phase].fetch_add(1)) < items[phase];) {
        run(phase, i);
        done[phase].fetch_add(1, std::memory_order_release);
      }
    }
  }
};

// y = x @ w[g] (or w[g]^T) per group.
struct Product : Phased {
  Groups groups;
  const bf16* x;
  Matrix w;  // the layer's [G, K, N]
  int64_t matrix;
  int depth, out_cols, panels;
  bool transpose;
  float* y;
  Product(Groups g) : groups(std::move(g)) {}
  void run(int item, bf16* panel) const {
    const int u = item / panels, c0 = (item % panels) * kPanel;
    const int cols = std::min(kPanel, out_cols - c0);
    const Matrix wg{w.w.from(groups.index[u] * matrix), w.ld};
    if (transpose)
      pack_columns(wg, c0, cols, depth, panel);
    else
      pack_rows(wg, 0, depth, c0, cols, panel);
    const int64_t first = groups.first[u];
    block_by_panel(x + first * depth, depth, 2, groups.size[u], panel, 2 * kPanel, depth / 2,
                   y + first * out_cols + c0, out_cols, cols);
  }
};

// dw[g] = x_g^T @ dy_g. Phase 0 packs the row pairs of each group (an odd group's last
// row paired with zeros) of x and dy; phase 1 multiplies, items (group, panel of N), the
// group's x pairs read down their columns (a_row = 2: one pair per column of x).
struct WeightGrad : Phased {
  Groups groups;
  Matrix x, dy;
  int k, n, panels;
  std::vector<int64_t> pair_first;  // per used group: its first pair
  std::vector<int64_t> pair_row;    // per pair: its first row (the second is the next row)
  std::vector<char> pair_full;      // per pair: whether the second row is the group's
  std::unique_ptr<bf16[]> xp, dyp;  // [pairs][K] and [pairs][N] pairs
  float* dw;
  WeightGrad(Groups g) : groups(std::move(g)) {}
  void pack(int pair) const {
    const int64_t r = pair_row[pair];
    for (int c = 0; c < k; c += 16)
      _mm512_mask_storeu_epi32(xp.get() + (pair * int64_t(k) + c) * 2, first_bits(k - c),
                               row_pairs(x, r, pair_full[pair], c, k - c));
    for (int c = 0; c < n; c += 16)
      _mm512_mask_storeu_epi32(dyp.get() + (pair * int64_t(n) + c) * 2, first_bits(n - c),
                               row_pairs(dy, r, pair_full[pair], c, n - c));
  }
  void multiply(int item) const {
    const int u = item / panels, c0 = (item % panels) * kPanel;
    const int cols = std::min(kPanel, n - c0);
    const int64_t p0 = pair_first[u];
    const int pairs = (groups.size[u] + 1) / 2;
    block_by_panel(xp.get() + p0 * 2 * k, 2, 2 * int64_t(k), k, dyp.get() + (p0 * n + c0) * 2,
                   2 * int64_t(n), pairs, dw + int64_t(groups.index[u]) * k * n + c0, n, cols, true);
    _mm_sfence();  // the streamed stores land before the item counts as done
  }
};

using ffi::DataType;

bool is_bf16(DataType t) { return t == DataType::BF16 || t == DataType::U16; }

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y, int64_t transpose) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  gpt_oss_cpu::Weights stack;
  if (xd.size() != 2 || wd.size() != 4 || group_sizes.element_count() != size_t(wd[1]) ||
      !is_bf16(x.element_type()) || !gpt_oss_cpu::as_weights(w, &stack))
    return ffi::Error::InvalidArgument(
        "grouped_matmul: x [M, D] bfloat16, w [L, G, K, N] float32 or bfloat16, sizes [G]");
  const int64_t k = wd[2], n = wd[3];
  if (xd[1] != (transpose ? n : k) || xd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("grouped_matmul: x's columns must be w's (even) depth");
  const int l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("grouped_matmul: layer out of range");
  auto job = std::make_shared<Product>(Groups(group_sizes.typed_data(), int(wd[1]), int(xd[0])));
  job->matrix = k * n;
  job->w = {stack.from(l * wd[1] * k * n), n};
  job->x = static_cast<const bf16*>(x.untyped_data());
  job->transpose = transpose != 0;
  job->depth = int(xd[1]);
  job->out_cols = int(transpose ? k : n);
  job->panels = (job->out_cols + kPanel - 1) / kPanel;
  job->y = y->typed_data();
  job->items[0] = job->groups.used() * job->panels;
  std::fill(job->y + job->groups.rows * job->out_cols, job->y + xd[0] * job->out_cols, 0.0f);
  gpt_oss_cpu::run_on_pool(pool, [job] {
    std::unique_ptr<bf16[]> panel(new bf16[int64_t(job->depth + 1) * kPanel]);
    job->work([&](int, int item) { job->run(item, panel.get()); });
  }, [&] { return job->finished(); });
  return ffi::Error::Success();
}

ffi::Error WeightGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> dw) {
  const auto xd = x.dimensions(), yd = dy.dimensions(), wd = dw->dimensions();
  gpt_oss_cpu::Weights xs, dys;
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0] || !is_bf16(x.element_type()) ||
      !gpt_oss_cpu::as_weights(x, &xs) || !gpt_oss_cpu::as_weights(dy, &dys) || wd.size() != 3 || wd[1] != xd[1] || wd[2] != yd[1] ||
      group_sizes.element_count() != size_t(wd[0]))
    return ffi::Error::InvalidArgument(
        "grouped_matmul_weight_grad: x [M, K] bfloat16, dy [M, N], sizes [G] -> dw [G, K, N]");
  auto job = std::make_shared<WeightGrad>(Groups(group_sizes.typed_data(), int(wd[0]), int(xd[0])));
  job->k = int(xd[1]);
  job->n = int(yd[1]);
  job->panels = (job->n + kPanel - 1) / kPanel;
  job->x = {xs, job->k};
  job->dy = {dys, job->n};
  job->dw = dw->typed_data();
  for (int u = 0; u < job->groups.used(); ++u) {
    job->pair_first.push_back(int64_t(job->pair_row.size()));
    for (int i = 0; i < job->groups.size[u]; i += 2) {
      job->pair_row.push_back(job->groups.first[u] + i);
      job->pair_full.push_back(i + 1 < job->groups.size[u]);
    }
  }
  const int64_t pairs = int64_t(job->pair_row.size());
  job->xp.reset(new bf16[pairs * job->k * 2]);
  // rows_by_panel reads a whole panel (kPanel pairs) of dy's pairs whatever `cols` is: on
  // the last panel of N (N < kPanel, or N % kPanel != 0) it reads past the last pair's
  // row by up to kPanel - 1 pairs. Within the buffer those lanes are the next row's and
  // are never stored; past its end they were a heap over-read, which faulted when the
  // buffer ended a page below unmapped memory (the top of a glibc arena's heap): the rare
  // segmentation fault of training steps on one CPU device, more often with an Orbax
  // save's threads allocating beside them. So one panel of zeros follows the pairs.
  job->dyp.reset(new bf16[(pairs * job->n + kPanel) * 2]);
  std::fill_n(job->dyp.get() + pairs * job->n * 2, 2 * kPanel, bf16(0));
  // Groups without rows: zero gradients (written here, not by an item).
  for (int g = 0, u = 0; g < int(wd[0]); ++g) {
    if (u < job->groups.used() && job->groups.index[u] == g) {
      ++u;
      continue;
    }
    std::fill(job->dw + int64_t(g) * job->k * job->n, job->dw + int64_t(g + 1) * job->k * job->n, 0.0f);
  }
  job->phases = 2;
  job->items[0] = int(pairs);
  job->items[1] = job->groups.used() * job->panels;
  gpt_oss_cpu::run_on_pool(pool, [job] {
    job->work([&](int phase, int item) {
      if (phase == 0)
        job->pack(item);
      else
        job->multiply(item);
    });
  }, [&] { return job->finished(); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K or N], BF16 or U16 bits
                                  .Arg<ffi::AnyBuffer>()  // w [L, G, K, N], F32, BF16 or U16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N or K]
                                  .Attr<int64_t>("transpose"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssGroupedMatmulWeightGrad, WeightGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K], BF16 or U16 bits
                                  .Arg<ffi::AnyBuffer>()  // dy [M, N], F32, BF16 or U16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dw [G, K, N]
