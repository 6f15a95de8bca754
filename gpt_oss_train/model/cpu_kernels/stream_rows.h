// Products of a few rows with a large float32 matrix, at memory bandwidth: the shared
// inner loops of the CPU kernels (moe_decode.cc, rows_matmul.cc).

#pragma once

#include <algorithm>
#include <cstdint>

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

// out[r, :n] = sum_d rows[r][d] * w[d * ldw + :n] for NR rows: the weight rows are read
// in order, kDepthStep at a time, swept together across the columns while the NR output
// rows stay in L1, so memory sees a few sequential streams and each output vector is
// loaded and stored once per kDepthStep weight rows. Bandwidth-bound for up to kRowBlock
// rows (a 2-core Zen 3 streams at its full read bandwidth this way; two weight rows per
// sweep reached 65%).
template <int NR>
void stream_rows(const float* const* rows, const float* w, int64_t ldw, int depth, int n,
                 float* out, int64_t ldo) {
  constexpr int S = kDepthStep;
  const int n8 = n / 8 * 8;
  for (int r = 0; r < NR; ++r) std::fill(out + r * ldo, out + r * ldo + n, 0.0f);
  int d = 0;
  for (; d + S <= depth; d += S) {
    const float* w0 = w + d * ldw;
    float xs[S][NR];
    for (int i = 0; i < S; ++i)
      for (int r = 0; r < NR; ++r) xs[i][r] = rows[r][d + i];
    for (int c = 0; c < n8; c += 8) {
      v8f ws[S];
      for (int i = 0; i < S; ++i) ws[i] = load8(w0 + i * ldw + c);
      for (int r = 0; r < NR; ++r) {
        v8f even = load8(out + r * ldo + c), odd = xs[1][r] * ws[1];  // two FMA chains
        even += xs[0][r] * ws[0];
        for (int i = 2; i < S; i += 2) {
          even += xs[i][r] * ws[i];
          odd += xs[i + 1][r] * ws[i + 1];
        }
        store8(out + r * ldo + c, even + odd);
      }
    }
    for (int c = n8; c < n; ++c)
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < S; ++i) out[r * ldo + c] += xs[i][r] * w0[i * ldw + c];
  }
  for (; d < depth; ++d)  // the last depth % S weight rows
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < n; ++c) out[r * ldo + c] += rows[r][d] * w[d * ldw + c];
}

// out[r, :n] = sum_d rows[r][d] * w[d * ldw + :n], for r < nrows, kRowBlock rows at a time
// (the next rows find the weights in cache: a work item's rows fit in L2).
void matmul_rows(const float* const* rows, int nrows, const float* w, int64_t ldw, int depth,
                 int n, float* out, int64_t ldo) {
  for (int r0 = 0; r0 < nrows; r0 += kRowBlock) {
    const float* const* rr = rows + r0;
    float* o = out + r0 * ldo;
    switch (std::min(kRowBlock, nrows - r0)) {
      case 1: stream_rows<1>(rr, w, ldw, depth, n, o, ldo); break;
      case 2: stream_rows<2>(rr, w, ldw, depth, n, o, ldo); break;
      case 3: stream_rows<3>(rr, w, ldw, depth, n, o, ldo); break;
      default: stream_rows<4>(rr, w, ldw, depth, n, o, ldo); break;
    }
  }
}

}  // namespace gpt_oss_cpu
