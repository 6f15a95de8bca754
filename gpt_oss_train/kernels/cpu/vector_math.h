// Elementwise math on 16 float32 lanes (AVX-512), shared by the CPU kernels that need
// what XLA:CPU computes slowly (self_attention.cc, cross_entropy.cc, glu.cc).

#pragma once

#include <cstdint>

#include <immintrin.h>

namespace gpt_oss_cpu {

// e^x for x <= 0 (and moderate x > 0): 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, with a
// degree-7 polynomial for 2^f (relative error ~1e-8, below float32's rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below this e^x is 0 in float32
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  // e^(f ln 2) = sum f'^k / k!, f' = f ln 2 in [-0.35, 0.35]
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The first min(n, 16) lanes (none for n <= 0): the mask of a row's last, partial vector.
inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : __mmask16((1u << n) - 1); }

// 16 bfloat16 values (their bits) widened to float32, lanes outside k zero.
inline __m512 widen16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

}  // namespace gpt_oss_cpu
