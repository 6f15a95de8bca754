// One AdamW step for one float32 parameter as an XLA FFI custom call: the gradient's
// per-token mean and global-norm clipping, both moments, bias correction, decoupled
// weight decay and the learning rate, in one pass over the parameter, its gradient and
// both moments, which it updates in place (the call's outputs alias p, m and v).
//
// Why a kernel: XLA:CPU runs optax's update of each parameter as three loops (first
// moment, second moment, parameter), so the gradient and the new moments cross memory
// twice; on the CPU benchmark's 517 M parameters that is ~20 GB a step where one pass
// moves 14 GB (docs/PERFORMANCE.md). The arithmetic is optax's, operation for operation
// (fused_adamw.py passes the scalars it would compute):
//
//   c  = g / n;  c = clip ? (c / norm) * max_norm : c
//   m' = (1 - b1) c + b1 m;       v' = (1 - b2) c^2 + b2 v
//   u  = (m' / bc1) / (sqrt(v' / bc2 + eps_root) + eps) + wd p;   p' = p + step * u

#include <algorithm>
#include <cstdint>
#include <memory>

#include <immintrin.h>

#include "stream_rows.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512F__
#error "adamw.cc needs AVX-512"
#endif

namespace ffi = xla::ffi;

namespace {

// The scalars operand, in this order.
enum Scalar { kN, kClip, kNorm, kMaxNorm, kB1, kB2, kBc1, kBc2, kEps, kEpsRoot, kWd, kStep, kCount };

constexpr int64_t kChunk = 1 << 16;  // elements an item updates

struct Job {
  const float *p, *g, *m, *v;
  float *po, *mo, *vo;
  float s[kCount];
  int64_t size;

  void run(int item) const {
    const int64_t lo = item * kChunk, hi = std::min(size, lo + kChunk);
    const __m512 n = _mm512_set1_ps(s[kN]), norm = _mm512_set1_ps(s[kNorm]),
                 max_norm = _mm512_set1_ps(s[kMaxNorm]), b1 = _mm512_set1_ps(s[kB1]),
                 b2 = _mm512_set1_ps(s[kB2]), one_b1 = _mm512_set1_ps(1.0f - s[kB1]),
                 one_b2 = _mm512_set1_ps(1.0f - s[kB2]), bc1 = _mm512_set1_ps(s[kBc1]),
                 bc2 = _mm512_set1_ps(s[kBc2]), eps = _mm512_set1_ps(s[kEps]),
                 eps_root = _mm512_set1_ps(s[kEpsRoot]), wd = _mm512_set1_ps(s[kWd]),
                 step = _mm512_set1_ps(s[kStep]);
    const bool clip = s[kClip] != 0.0f;
    for (int64_t i = lo; i < hi; i += 16) {
      const __mmask16 k = hi - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (hi - i)) - 1);
      __m512 c = _mm512_div_ps(_mm512_maskz_loadu_ps(k, g + i), n);
      if (clip) c = _mm512_mul_ps(_mm512_div_ps(c, norm), max_norm);
      // Products and sums rounded one at a time, as XLA evaluates optax's expressions.
      const __m512 m1 = _mm512_add_ps(_mm512_mul_ps(one_b1, c),
                                      _mm512_mul_ps(b1, _mm512_maskz_loadu_ps(k, m + i)));
      const __m512 v1 = _mm512_add_ps(_mm512_mul_ps(one_b2, _mm512_mul_ps(c, c)),
                                      _mm512_mul_ps(b2, _mm512_maskz_loadu_ps(k, v + i)));
      const __m512 den = _mm512_add_ps(
          _mm512_sqrt_ps(_mm512_add_ps(_mm512_div_ps(v1, bc2), eps_root)), eps);
      const __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
      __m512 u = _mm512_div_ps(_mm512_div_ps(m1, bc1), den);
      u = _mm512_add_ps(u, _mm512_mul_ps(wd, pv));
      _mm512_mask_storeu_ps(po + i, k, _mm512_add_ps(pv, _mm512_mul_ps(u, step)));
      _mm512_mask_storeu_ps(mo + i, k, m1);
      _mm512_mask_storeu_ps(vo + i, k, v1);
    }
  }
};

ffi::Error AdamWImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> g,
                     ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::F32> scalars, ffi::ResultBuffer<ffi::F32> po,
                     ffi::ResultBuffer<ffi::F32> mo, ffi::ResultBuffer<ffi::F32> vo) {
  const size_t size = p.element_count();
  if (g.element_count() != size || m.element_count() != size || v.element_count() != size ||
      scalars.element_count() != size_t(kCount))
    return ffi::Error::InvalidArgument("adamw: p, g, m, v of one shape, scalars [13]");
  auto job = std::make_shared<Job>();
  job->p = p.typed_data();
  job->g = g.typed_data();
  job->m = m.typed_data();
  job->v = v.typed_data();
  job->po = po->typed_data();
  job->mo = mo->typed_data();
  job->vo = vo->typed_data();
  std::copy(scalars.typed_data(), scalars.typed_data() + kCount, job->s);
  job->size = int64_t(size);
  const int items = int((job->size + kChunk - 1) / kChunk);
  gpt_oss_cpu::run_items(pool, items, [job](int i) { job->run(i); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssAdamW, AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // p
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g (summed over tokens)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scalars [kCount]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // p' (aliases p)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m' (aliases m)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v' (aliases v)
