// The loss's softmax over the vocabulary and its gradient, as XLA FFI custom calls on
// CPUs with AVX512-BF16 (training/loss.py, one chunk of rows at a time):
//
//   GptOssSoftmaxXent:      logits f32 [R, V], targets s32 [R]
//                           -> lse f32 [R], target logit f32 [R], probs bf16 [R, V]
//   GptOssSoftmaxXentGrad:  probs bf16 [R, V], targets s32 [R], scale f32 [R], add f32 [R]
//                           -> g bf16 [R, V] = scale[r] * probs + (v == t[r] ? add[r] : 0)
//
// lse = max + log(sum exp(logits - max)); probs = exp(logits - lse). bfloat16 results are
// rounded to nearest even, as XLA's convert. A target outside [0, V) reads the clamped
// column in the forward and matches no column in the gradient (padding is masked out).
//
// Why kernels: XLA:CPU fused the softmax's exponentials into the backward's loop (keeping
// the float32 logits alive until then) and ran it at ~3 ns an element, 0.2 s a step for
// the CPU benchmark's [2048, 32768] chunk (docs/PERFORMANCE.md); here a row stays in L2
// across its passes and 16 lanes go at a time.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include <immintrin.h>

#include "stream_rows.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512BF16__
#error "cross_entropy.cc needs AVX512-BF16 (vcvtneps2bf16)"
#endif

namespace ffi = xla::ffi;

namespace {

using gpt_oss_cpu::bf16;
using gpt_oss_cpu::exp16;
using gpt_oss_cpu::lanes;
using gpt_oss_cpu::widen16;

constexpr int kRowsPerItem = 4;

__m256i round_bf16(__m512 x) { return __m256i(_mm512_cvtneps_pbh(x)); }

struct Forward {
  const float* logits;
  const int32_t* targets;
  float *lse, *target;
  bf16* probs;
  int64_t rows, vocab;

  void row(int64_t r) const {
    const float* l = logits + r * vocab;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < vocab; c += 16)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(vocab - c), l + c));
    const float mx = _mm512_reduce_max_ps(top);
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < vocab; c += 16) {
      const __mmask16 k = lanes(vocab - c);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + c), m))));
    }
    const float ls = mx + std::log(_mm512_reduce_add_ps(sum));
    lse[r] = ls;
    target[r] = l[std::clamp<int64_t>(targets[r], 0, vocab - 1)];
    const __m512 s = _mm512_set1_ps(ls);
    bf16* p = probs + r * vocab;
    for (int64_t c = 0; c < vocab; c += 16) {
      const __mmask16 k = lanes(vocab - c);
      _mm256_mask_storeu_epi16(p + c, k, round_bf16(exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + c), s))));
    }
  }
};

struct Grad {
  const bf16* probs;
  const int32_t* targets;
  const float *scale, *add;
  bf16* g;
  int64_t rows, vocab;

  void row(int64_t r) const {
    const bf16* p = probs + r * vocab;
    bf16* out = g + r * vocab;
    const __m512 s = _mm512_set1_ps(scale[r]);
    for (int64_t c = 0; c < vocab; c += 16) {
      const __mmask16 k = lanes(vocab - c);
      _mm256_mask_storeu_epi16(out + c, k, round_bf16(_mm512_mul_ps(s, widen16(p + c, k))));
    }
    const int64_t t = targets[r];
    if (t >= 0 && t < vocab) {
      const float x = scale[r] * gpt_oss_cpu::widen(p[t]) + add[r];
      _mm256_mask_storeu_epi16(out + t, 1, round_bf16(_mm512_set1_ps(x)));
    }
  }
};

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                       ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> target,
                       ffi::ResultBuffer<ffi::BF16> probs) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || targets.element_count() != size_t(d[0]) || d[1] < 1)
    return ffi::Error::InvalidArgument("softmax_xent: logits [R, V], targets [R]");
  auto job = std::make_shared<Forward>();
  job->logits = logits.typed_data();
  job->targets = targets.typed_data();
  job->lse = lse->typed_data();
  job->target = target->typed_data();
  job->probs = reinterpret_cast<bf16*>(probs->untyped_data());
  job->rows = d[0];
  job->vocab = d[1];
  gpt_oss_cpu::run_rows(pool, job->rows, kRowsPerItem, [job](int64_t r) { job->row(r); });
  return ffi::Error::Success();
}

ffi::Error GradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> probs, ffi::Buffer<ffi::S32> targets,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> add, ffi::ResultBuffer<ffi::BF16> g) {
  const auto d = probs.dimensions();
  const size_t rows = d.size() == 2 ? size_t(d[0]) : 0;
  if (d.size() != 2 || targets.element_count() != rows || scale.element_count() != rows ||
      add.element_count() != rows)
    return ffi::Error::InvalidArgument("softmax_xent_grad: probs [R, V], targets, scale, add [R]");
  auto job = std::make_shared<Grad>();
  job->probs = reinterpret_cast<const bf16*>(probs.untyped_data());
  job->targets = targets.typed_data();
  job->scale = scale.typed_data();
  job->add = add.typed_data();
  job->g = reinterpret_cast<bf16*>(g->untyped_data());
  job->rows = d[0];
  job->vocab = d[1];
  gpt_oss_cpu::run_rows(pool, job->rows, kRowsPerItem, [job](int64_t r) { job->row(r); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssSoftmaxXent, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [R, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // targets [R]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [R]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // target logit [R]
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // probs [R, V]

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssSoftmaxXentGrad, GradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // probs [R, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // targets [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // add [R]
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // g [R, V]
