// The experts' gated activation with its biases, forward and backward, as XLA FFI custom
// calls on CPUs with AVX512-BF16 (model/moe.py, between the grouped matmuls). Row r
// belongs to expert e[r]:
//
//   g = gate + bg[e];  u = up + bu[e];  gc = min(g, limit);  uc = clip(u, -limit, limit)
//   act = gc * sigmoid(alpha * gc) * (uc + 1)                       (bfloat16 result)
//
// GptOssGlu: gate, up f32 [R, F], bg, bu f32 [E, F], e s32 [R] -> act bf16 [R, F]
// GptOssGluGrad: the same and dact bf16 [R, F] -> dgate, dup f32 [R, F], dbg, dbu f32 [E, F]
//
// The derivatives are autodiff's of the expression above, ties included (min and clip
// pass half the gradient where the value equals the limit, as lax.min and lax.max do).
// Bias gradients are per-expert sums over rows, taken column by column (no atomics).
//
// Why kernels: XLA:CPU ran these as loop fusions at ~3 ns an element (the sigmoid's
// exponential and division), with the bias gathers and their scatter-add gradients
// beside them: ~0.3 s of busy time a step on the CPU benchmark (docs/PERFORMANCE.md).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "stream_rows.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512BF16__
#error "glu.cc needs AVX512-BF16 (vcvtneps2bf16)"
#endif

namespace ffi = xla::ffi;

namespace {

using gpt_oss_cpu::bf16;
using gpt_oss_cpu::exp16;
using gpt_oss_cpu::lanes;
using gpt_oss_cpu::widen16;

constexpr int kRowsPerItem = 16;
constexpr int kColumns = 16;  // columns of a bias-gradient item: one vector

// 1, 1/2 or 0: the derivative of min(x, hi) in x (lax.min splits a tie evenly).
__m512 below(__m512 x, __m512 hi) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
  const __m512 d = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, hi, _CMP_LT_OQ), one);
  return _mm512_mask_mov_ps(d, _mm512_cmp_ps_mask(x, hi, _CMP_EQ_OQ), half);
}

struct Glu {
  const float *gate, *up, *bg, *bu;
  const int32_t* e;
  const bf16* dact = nullptr;  // the backward's
  bf16* act = nullptr;         // the forward's
  float *dgate = nullptr, *dup = nullptr, *dbg = nullptr, *dbu = nullptr;
  int64_t rows, cols, experts;
  float limit, alpha;

  void row(int64_t r) const {
    const int64_t x = std::clamp<int64_t>(e[r], 0, experts - 1);
    const float *gr = gate + r * cols, *ur = up + r * cols, *bgr = bg + x * cols, *bur = bu + x * cols;
    const __m512 lim = _mm512_set1_ps(limit), neg = _mm512_set1_ps(-limit), al = _mm512_set1_ps(alpha),
                 one = _mm512_set1_ps(1.0f);
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 k = lanes(cols - c);
      const __m512 g = _mm512_add_ps(_mm512_maskz_loadu_ps(k, gr + c), _mm512_maskz_loadu_ps(k, bgr + c));
      const __m512 u = _mm512_add_ps(_mm512_maskz_loadu_ps(k, ur + c), _mm512_maskz_loadu_ps(k, bur + c));
      const __m512 gc = _mm512_min_ps(g, lim);
      const __m512 uc = _mm512_min_ps(_mm512_max_ps(u, neg), lim);
      const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), al), gc))));
      const __m512 u1 = _mm512_add_ps(uc, one);
      const __m512 gs = _mm512_mul_ps(gc, s);
      if (act) {
        _mm256_mask_storeu_epi16(act + r * cols + c, k, __m256i(_mm512_cvtneps_pbh(_mm512_mul_ps(gs, u1))));
        continue;
      }
      const __m512 d = widen16(dact + r * cols + c, k);
      // d act / d gc = (uc + 1) (s + gc * alpha * s (1 - s)); d act / d uc = gc s
      const __m512 dgc = _mm512_mul_ps(u1, _mm512_add_ps(s, _mm512_mul_ps(_mm512_mul_ps(gs, al), _mm512_sub_ps(one, s))));
      const __m512 in_band = _mm512_mul_ps(below(neg, u), below(u, lim));
      _mm512_mask_storeu_ps(dgate + r * cols + c, k, _mm512_mul_ps(_mm512_mul_ps(d, dgc), below(g, lim)));
      _mm512_mask_storeu_ps(dup + r * cols + c, k, _mm512_mul_ps(_mm512_mul_ps(d, gs), in_band));
    }
  }

  // dbg, dbu for columns [16 i, 16 i + 16): sums over the rows of each expert.
  void bias_columns(int item) const {
    const int64_t c = int64_t(item) * kColumns;
    const __mmask16 k = lanes(cols - c);
    std::vector<__m512> sg(experts, _mm512_setzero_ps()), su(experts, _mm512_setzero_ps());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t x = std::clamp<int64_t>(e[r], 0, experts - 1);
      sg[x] = _mm512_add_ps(sg[x], _mm512_maskz_loadu_ps(k, dgate + r * cols + c));
      su[x] = _mm512_add_ps(su[x], _mm512_maskz_loadu_ps(k, dup + r * cols + c));
    }
    for (int64_t x = 0; x < experts; ++x) {
      _mm512_mask_storeu_ps(dbg + x * cols + c, k, sg[x]);
      _mm512_mask_storeu_ps(dbu + x * cols + c, k, su[x]);
    }
  }
};

template <class A, class B>
bool same(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error Check(ffi::Buffer<ffi::F32>& gate, ffi::Buffer<ffi::F32>& up, ffi::Buffer<ffi::F32>& bg,
                 ffi::Buffer<ffi::F32>& bu, ffi::Buffer<ffi::S32>& e) {
  const auto d = gate.dimensions(), b = bg.dimensions();
  if (d.size() != 2 || b.size() != 2 || b[1] != d[1] || b[0] < 1 || !same(up.dimensions(), d) ||
      !same(bu.dimensions(), b) || e.element_count() != size_t(d[0]))
    return ffi::Error::InvalidArgument("glu: gate, up [R, F], bg, bu [E, F], e [R]");
  return ffi::Error::Success();
}

std::shared_ptr<Glu> Make(ffi::Buffer<ffi::F32>& gate, ffi::Buffer<ffi::F32>& up, ffi::Buffer<ffi::F32>& bg,
                          ffi::Buffer<ffi::F32>& bu, ffi::Buffer<ffi::S32>& e, float limit, float alpha) {
  auto job = std::make_shared<Glu>();
  job->gate = gate.typed_data();
  job->up = up.typed_data();
  job->bg = bg.typed_data();
  job->bu = bu.typed_data();
  job->e = e.typed_data();
  job->rows = gate.dimensions()[0];
  job->cols = gate.dimensions()[1];
  job->experts = bg.dimensions()[0];
  job->limit = limit;
  job->alpha = alpha;
  return job;
}

ffi::Error GluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up,
                   ffi::Buffer<ffi::F32> bg, ffi::Buffer<ffi::F32> bu, ffi::Buffer<ffi::S32> e,
                   ffi::ResultBuffer<ffi::BF16> act, float limit, float alpha) {
  if (auto error = Check(gate, up, bg, bu, e); error.failure()) return error;
  auto job = Make(gate, up, bg, bu, e, limit, alpha);
  job->act = reinterpret_cast<bf16*>(act->untyped_data());
  gpt_oss_cpu::run_rows(pool, job->rows, kRowsPerItem, [job](int64_t r) { job->row(r); });
  return ffi::Error::Success();
}

ffi::Error GluGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up,
                       ffi::Buffer<ffi::F32> bg, ffi::Buffer<ffi::F32> bu, ffi::Buffer<ffi::S32> e,
                       ffi::Buffer<ffi::BF16> dact, ffi::ResultBuffer<ffi::F32> dgate,
                       ffi::ResultBuffer<ffi::F32> dup, ffi::ResultBuffer<ffi::F32> dbg,
                       ffi::ResultBuffer<ffi::F32> dbu, float limit, float alpha) {
  if (auto error = Check(gate, up, bg, bu, e); error.failure()) return error;
  if (!same(dact.dimensions(), gate.dimensions()))
    return ffi::Error::InvalidArgument("glu_grad: dact [R, F]");
  auto job = Make(gate, up, bg, bu, e, limit, alpha);
  job->dact = reinterpret_cast<const bf16*>(dact.untyped_data());
  job->dgate = dgate->typed_data();
  job->dup = dup->typed_data();
  job->dbg = dbg->typed_data();
  job->dbu = dbu->typed_data();
  gpt_oss_cpu::run_rows(pool, job->rows, kRowsPerItem, [job](int64_t r) { job->row(r); });
  const int items = int((job->cols + kColumns - 1) / kColumns);
  gpt_oss_cpu::run_items(pool, items, [job](int i) { job->bias_columns(i); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssGlu, GluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [R, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // up [R, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bg [E, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bu [E, F]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // e [R]
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // act [R, F]
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssGluGrad, GluGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [R, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // up [R, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bg [E, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bu [E, F]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // e [R]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // dact [R, F]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dgate [R, F]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dup [R, F]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dbg [E, F]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dbu [E, F]
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha"));
