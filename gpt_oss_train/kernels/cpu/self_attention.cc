// Self-attention over whole sequences (training and prefill) on CPUs with AVX-512, forward
// and backward, as XLA FFI custom calls, in the manner of FlashAttention: blocks of
// queries meet blocks of keys, the softmax is taken online, and no [queries, keys] array
// ever leaves the core's cache.
//
//   GptOssSelfAttention:      q, k, v, sinks, pos, seg -> out [b, s, n, h], lse [b, n, s]
//   GptOssSelfAttentionGrad:  q, k, v, sinks, pos, seg, out, lse, dout
//                             -> dq [b, s, n, h], dk, dv [b, s, kh, h], dsinks [b, n]
//
// Semantics (gpt-oss, as xla/attention.py's xla_attention): grouped-query attention,
// query head i*g + j reading KV head i; scale 1/sqrt(h); one sink logit per query head in
// the softmax denominator only. Key j is visible to query i when 0 <= pos_j <= pos_i,
// seg_j == seg_i and (window > 0) pos_i - pos_j < window: the mask is evaluated per pair,
// so any positions and segments are exact; blocks where no pair is visible are skipped,
// which is what makes causal and banded layers cheaper. A query that sees no key gets 0.
// lse is the log of each query's softmax denominator, sink included.
//
// Why a kernel: XLA:CPU computes the [b, heads, s, s] float32 logits, mask, exponentials
// and probabilities as separate passes over memory, and transposes them for the backward
// products (docs/PERFORMANCE.md); here every block product is a register-blocked float32
// matmul on tiles that stay in L1/L2. q, k, v and dout are float32 or bfloat16 (widened as
// read); the arithmetic and the results are float32.
//
// Work items are (batch row, KV head), claimed by the threads of XLA's intra-op pool: an
// item owns its dk and dv rows and its g query heads, so no two items write the same
// memory.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "stream_rows.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

// Built only where the compiler targets AVX-512 (-march=native on such a CPU): a failed
// build leaves the registry on the XLA reference (xla/attention.py).
#ifndef __AVX512F__
#error "self_attention.cc needs AVX-512"
#endif

namespace ffi = xla::ffi;
using gpt_oss_cpu::exp16;

namespace {

constexpr int kBlock = 64;  // queries of a query block; keys of a key block
constexpr int kTileRows = 6;

// c[r, :16 NC] (or +=) sum_d a[r, d] b[d, :16 NC] for r < R: R x NC vectors of sums in
// registers across the whole depth.
template <int R, int NC>
inline void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int depth, float* c,
                 int64_t ldc, bool add) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NC; ++j)
      acc[r][j] = add ? _mm512_loadu_ps(c + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (int d = 0; d < depth; ++d) {
    __m512 bv[NC];
    for (int j = 0; j < NC; ++j) bv[j] = _mm512_loadu_ps(b + d * ldb + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + d]);
      for (int j = 0; j < NC; ++j) acc[r][j] = _mm512_fmadd_ps(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}

template <int NC>
inline void tile_rows(int rows, const float* a, int64_t lda, const float* b, int64_t ldb,
                      int depth, float* c, int64_t ldc, bool add) {
  switch (rows) {
    case 1: tile<1, NC>(a, lda, b, ldb, depth, c, ldc, add); break;
    case 2: tile<2, NC>(a, lda, b, ldb, depth, c, ldc, add); break;
    case 3: tile<3, NC>(a, lda, b, ldb, depth, c, ldc, add); break;
    case 4: tile<4, NC>(a, lda, b, ldb, depth, c, ldc, add); break;
    case 5: tile<5, NC>(a, lda, b, ldb, depth, c, ldc, add); break;
    default: tile<6, NC>(a, lda, b, ldb, depth, c, ldc, add); break;
  }
}

// c [m, n] (or +=) a [m, depth] @ b [depth, n], row-major with the given row strides;
// n a multiple of 16.
void gemm(int m, int n, int depth, const float* a, int64_t lda, const float* b, int64_t ldb,
          float* c, int64_t ldc, bool add) {
  for (int c0 = 0; c0 < n; c0 += 64) {
    const int nc = std::min(4, (n - c0) / 16);
    for (int r0 = 0; r0 < m; r0 += kTileRows) {
      const int rows = std::min(kTileRows, m - r0);
      const float* ar = a + r0 * lda;
      float* cr = c + r0 * ldc + c0;
      switch (nc) {
        case 1: tile_rows<1>(rows, ar, lda, b + c0, ldb, depth, cr, ldc, add); break;
        case 2: tile_rows<2>(rows, ar, lda, b + c0, ldb, depth, cr, ldc, add); break;
        case 3: tile_rows<3>(rows, ar, lda, b + c0, ldb, depth, cr, ldc, add); break;
        default: tile_rows<4>(rows, ar, lda, b + c0, ldb, depth, cr, ldc, add); break;
      }
    }
  }
}

// The operands of one call, and the layout of one item's local float32 copies.
struct Problem {
  int b, s, n, kh, g, h;
  int64_t window;  // 0: no band
  float scale;
  gpt_oss_cpu::Weights q, k, v;  // [b, s, n, h], [b, s, kh, h] x2
  const float* sinks;            // [n]
  const int32_t *pos, *seg;      // [b, s]
  int blocks() const { return (s + kBlock - 1) / kBlock; }
  int rows() const { return g * kBlock; }  // a query block's rows: g heads x kBlock queries
  int items() const { return b * kh; }
};

inline float read(const gpt_oss_cpu::Weights& w, int64_t i) {
  return w.bf16 ? gpt_oss_cpu::widen(*w.at<gpt_oss_cpu::bf16>(i)) : *w.at<float>(i);
}

// Bit j of mask[i]: key kb * kBlock + j visible to query qb * kBlock + i. False when the
// block pair has no visible pair.
bool block_mask(const Problem& p, int row, int qb, int kb, uint64_t* mask) {
  const int32_t* pos = p.pos + int64_t(row) * p.s;
  const int32_t* seg = p.seg + int64_t(row) * p.s;
  const int q0 = qb * kBlock, k0 = kb * kBlock;
  const int nk = std::min(kBlock, p.s - k0);
  alignas(64) int32_t kp[kBlock], ks[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    kp[j] = j < nk ? pos[k0 + j] : -1;  // past the sequence: an empty slot
    ks[j] = j < nk ? seg[k0 + j] : 0;
  }
  bool any = false;
  for (int i = 0; i < kBlock; ++i) {
    mask[i] = 0;
    if (q0 + i >= p.s) continue;
    const __m512i qp = _mm512_set1_epi32(pos[q0 + i]), qs = _mm512_set1_epi32(seg[q0 + i]);
    for (int c = 0; c < kBlock; c += 16) {
      const __m512i kpv = _mm512_load_si512(kp + c), ksv = _mm512_load_si512(ks + c);
      __mmask16 m = _mm512_cmpge_epi32_mask(kpv, _mm512_setzero_si512()) &
                    _mm512_cmple_epi32_mask(kpv, qp) & _mm512_cmpeq_epi32_mask(ksv, qs);
      if (p.window > 0)
        m &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(qp, kpv),
                                     _mm512_set1_epi32(int32_t(p.window)));
      mask[i] |= uint64_t(m) << c;
    }
    any |= mask[i] != 0;
  }
  return any;
}

// One item's operands as float32 blocks: queries [blocks][g][kBlock][h] (scaled), keys
// and values [blocks * kBlock][h], and keys transposed per block [blocks][h][kBlock].
// Rows past the sequence are zeros.
struct Local {
  int h, rows, nb;
  std::vector<float> q, k, v, kt;
  Local(const Problem& p, int row, int head)
      : h(p.h), rows(p.rows()), nb(p.blocks()),
        q(size_t(nb) * rows * h, 0.0f), k(size_t(nb) * kBlock * h, 0.0f), v(k.size(), 0.0f),
        kt(k.size(), 0.0f) {
    for (int t = 0; t < p.s; ++t) {
      const int64_t kv = ((int64_t(row) * p.s + t) * p.kh + head) * h;
      for (int d = 0; d < h; ++d) {
        k[t * h + d] = read(p.k, kv + d);
        v[t * h + d] = read(p.v, kv + d);
        kt[(t / kBlock * h + d) * kBlock + t % kBlock] = k[t * h + d];
      }
      for (int j = 0; j < p.g; ++j) {
        const int64_t qi = ((int64_t(row) * p.s + t) * p.n + head * p.g + j) * h;
        float* dst = query_row(t, j);
        for (int d = 0; d < h; ++d) dst[d] = read(p.q, qi + d) * p.scale;
      }
    }
  }
  float* query_row(int t, int j) { return &q[((size_t(t / kBlock) * (rows / kBlock) + j) * kBlock + t % kBlock) * h]; }
  const float* query_block(int qb) const { return &q[size_t(qb) * rows * h]; }
};

// s [rows, kBlock] = q block @ k block^T.
void scores(const Local& l, int qb, int kb, float* s) {
  gemm(l.rows, kBlock, l.h, l.query_block(qb), l.h, &l.kt[size_t(kb) * l.h * kBlock], kBlock, s,
       kBlock, false);
}

// The forward of one item: online softmax over its visible key blocks.
void forward_item(const Problem& p, int item, float* out, float* lse) {
  const int row = item / p.kh, head = item % p.kh, h = p.h, rows = p.rows();
  Local l(p, row, head);
  std::vector<float> s(size_t(rows) * kBlock), acc(size_t(rows) * h), m(rows), sum(rows);
  uint64_t mask[kBlock];
  for (int qb = 0; qb < l.nb; ++qb) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int kb = 0; kb < l.nb; ++kb) {
      if (!block_mask(p, row, qb, kb, mask)) continue;
      scores(l, qb, kb, s.data());
      for (int r = 0; r < rows; ++r) {
        const uint64_t bits = mask[r % kBlock];
        float* sr = &s[size_t(r) * kBlock];
        if (!bits) {  // nothing visible to this query here: adds nothing to its sums
          std::fill(sr, sr + kBlock, 0.0f);
          continue;
        }
        __m512 mx = _mm512_set1_ps(m[r]);
        for (int c = 0; c < kBlock; c += 16)
          mx = _mm512_mask_max_ps(mx, __mmask16(bits >> c), mx, _mm512_loadu_ps(sr + c));
        const float m_new = _mm512_reduce_max_ps(mx);
        const float alpha = std::exp(m[r] - m_new);  // 0 on the first visible block
        __m512 total = _mm512_setzero_ps();
        for (int c = 0; c < kBlock; c += 16) {
          const __m512 e = _mm512_maskz_mov_ps(
              __mmask16(bits >> c), exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), _mm512_set1_ps(m_new))));
          _mm512_storeu_ps(sr + c, e);
          total = _mm512_add_ps(total, e);
        }
        sum[r] = sum[r] * alpha + _mm512_reduce_add_ps(total);
        m[r] = m_new;
        float* ar = &acc[size_t(r) * h];
        for (int d = 0; d < h; ++d) ar[d] *= alpha;
      }
      gemm(rows, h, kBlock, s.data(), kBlock, &l.v[size_t(kb) * kBlock * h], h, acc.data(), h, true);
    }
    for (int r = 0; r < rows; ++r) {
      const int j = r / kBlock, t = qb * kBlock + r % kBlock, qh = head * p.g + j;
      if (t >= p.s) continue;
      const float sink = p.sinks[qh];
      const float top = std::max(m[r], sink);  // finite: the sink is
      const float denom = sum[r] * std::exp(m[r] - top) + std::exp(sink - top);
      const float w = std::exp(m[r] - top) / denom;  // 0 when no key was visible
      float* o = out + ((int64_t(row) * p.s + t) * p.n + qh) * h;
      for (int d = 0; d < h; ++d) o[d] = acc[size_t(r) * h + d] * (sum[r] > 0 ? w : 0.0f);
      lse[(int64_t(row) * p.n + qh) * p.s + t] = top + std::log(denom);
    }
  }
}

// The backward of one item (FlashAttention-2's, without atomics: the item owns its dk, dv
// and dq rows). With P = exp(S - lse), D_r = dout_r . out_r:
//   dv += P^T dout,  dP = dout v^T,  dS = P (dP - D),  dk += dS^T q_scaled,  dq += scale dS k
//   dsink = -sum_r exp(sink - lse_r) D_r
struct Grads {
  gpt_oss_cpu::Weights out, dout;  // [b, s, n, h]
  const float* lse;                // [b, n, s]
  float *dq, *dk, *dv, *dsinks;    // [b, s, n, h], [b, s, kh, h] x2, [b, n]
};

void backward_item(const Problem& p, const Grads& gr, int item) {
  const int row = item / p.kh, head = item % p.kh, h = p.h, rows = p.rows();
  Local l(p, row, head);
  const size_t qsize = l.q.size();
  std::vector<float> dout(qsize, 0.0f), dq(qsize, 0.0f), dk(l.k.size(), 0.0f),
      dv(l.k.size(), 0.0f), vt(l.k.size(), 0.0f), lse(size_t(l.nb) * rows, 0.0f),
      dd(lse.size(), 0.0f), s(size_t(rows) * kBlock), dp(s.size()), st(s.size());
  for (int t = 0; t < p.s; ++t)
    for (int d = 0; d < h; ++d) vt[(t / kBlock * h + d) * kBlock + t % kBlock] = l.v[t * h + d];
  std::vector<float> dsink(p.g, 0.0f);
  for (int t = 0; t < p.s; ++t)
    for (int j = 0; j < p.g; ++j) {
      const int qh = head * p.g + j;
      const int64_t at = ((int64_t(row) * p.s + t) * p.n + qh) * h;
      const size_t r = (size_t(t / kBlock) * p.g + j) * kBlock + t % kBlock;
      float dot = 0.0f;
      for (int d = 0; d < h; ++d) {
        const float g = read(gr.dout, at + d);
        dout[r * h + d] = g;
        dot += g * read(gr.out, at + d);
      }
      dd[r] = dot;
      lse[r] = gr.lse[(int64_t(row) * p.n + qh) * p.s + t];
      dsink[j] -= std::exp(p.sinks[qh] - lse[r]) * dot;
    }
  uint64_t mask[kBlock];
  for (int qb = 0; qb < l.nb; ++qb) {
    const float* qblock = l.query_block(qb);
    const float* dblock = &dout[size_t(qb) * rows * h];
    for (int kb = 0; kb < l.nb; ++kb) {
      if (!block_mask(p, row, qb, kb, mask)) continue;
      scores(l, qb, kb, s.data());
      gemm(rows, kBlock, h, dblock, h, &vt[size_t(kb) * h * kBlock], kBlock, dp.data(), kBlock,
           false);
      for (int r = 0; r < rows; ++r) {
        const uint64_t bits = mask[r % kBlock];
        const size_t at = size_t(qb) * rows + r;
        const __m512 lr = _mm512_set1_ps(lse[at]), dr = _mm512_set1_ps(dd[at]);
        float* sr = &s[size_t(r) * kBlock];
        float* dpr = &dp[size_t(r) * kBlock];
        for (int c = 0; c < kBlock; c += 16) {
          const __m512 pr = _mm512_maskz_mov_ps(
              __mmask16(bits >> c), exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), lr)));
          _mm512_storeu_ps(sr + c, pr);  // P
          _mm512_storeu_ps(dpr + c, _mm512_mul_ps(pr, _mm512_sub_ps(_mm512_loadu_ps(dpr + c), dr)));
        }
      }
      // dv += P^T dout, dk += dS^T q (P and dS transposed into st first)
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < kBlock; ++c) st[size_t(c) * rows + r] = s[size_t(r) * kBlock + c];
      gemm(kBlock, h, rows, st.data(), rows, dblock, h, &dv[size_t(kb) * kBlock * h], h, true);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < kBlock; ++c) st[size_t(c) * rows + r] = dp[size_t(r) * kBlock + c];
      gemm(kBlock, h, rows, st.data(), rows, qblock, h, &dk[size_t(kb) * kBlock * h], h, true);
      gemm(rows, h, kBlock, dp.data(), kBlock, &l.k[size_t(kb) * kBlock * h], h,
           &dq[size_t(qb) * rows * h], h, true);
    }
  }
  for (int t = 0; t < p.s; ++t) {
    const int64_t kv = ((int64_t(row) * p.s + t) * p.kh + head) * h;
    std::copy(&dk[size_t(t) * h], &dk[size_t(t + 1) * h], gr.dk + kv);
    std::copy(&dv[size_t(t) * h], &dv[size_t(t + 1) * h], gr.dv + kv);
    for (int j = 0; j < p.g; ++j) {
      const size_t r = (size_t(t / kBlock) * p.g + j) * kBlock + t % kBlock;
      float* dst = gr.dq + ((int64_t(row) * p.s + t) * p.n + head * p.g + j) * h;
      for (int d = 0; d < h; ++d) dst[d] = dq[r * h + d] * p.scale;
    }
  }
  for (int j = 0; j < p.g; ++j) gr.dsinks[int64_t(row) * p.n + head * p.g + j] = dsink[j];
}

ffi::Error read_problem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> pos,
                        ffi::Buffer<ffi::S32> seg, int64_t window, Problem* p) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.dimensions().size() != 4 || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[3] != qd[3] || qd[2] % kd[2] != 0 || qd[3] % 16 != 0 ||
      sinks.element_count() != size_t(qd[2]) || pos.element_count() != size_t(qd[0] * qd[1]) ||
      seg.element_count() != size_t(qd[0] * qd[1]) || !gpt_oss_cpu::as_weights(q, &p->q) ||
      !gpt_oss_cpu::as_weights(k, &p->k) || !gpt_oss_cpu::as_weights(v, &p->v))
    return ffi::Error::InvalidArgument(
        "self_attention: q [b, s, n, h], k/v [b, s, kh, h] (h a multiple of 16), sinks [n], "
        "pos/seg [b, s]");
  p->b = int(qd[0]);
  p->s = int(qd[1]);
  p->n = int(qd[2]);
  p->kh = int(kd[2]);
  p->g = p->n / p->kh;
  p->h = int(qd[3]);
  p->window = window;
  p->scale = 1.0f / std::sqrt(float(p->h));
  p->sinks = sinks.typed_data();
  p->pos = pos.typed_data();
  p->seg = seg.typed_data();
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> pos,
                       ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> lse, int64_t window) {
  Problem p;
  if (auto e = read_problem(q, k, v, sinks, pos, seg, window, &p); e.failure()) return e;
  float *o = out->typed_data(), *l = lse->typed_data();
  gpt_oss_cpu::run_items(pool, p.items(), [p, o, l](int item) { forward_item(p, item, o, l); });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> pos,
                        ffi::Buffer<ffi::S32> seg, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
                        ffi::AnyBuffer dout, ffi::ResultBuffer<ffi::F32> dq,
                        ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                        ffi::ResultBuffer<ffi::F32> dsinks, int64_t window) {
  Problem p;
  if (auto e = read_problem(q, k, v, sinks, pos, seg, window, &p); e.failure()) return e;
  Grads gr;
  if (!gpt_oss_cpu::as_weights(out, &gr.out) || !gpt_oss_cpu::as_weights(dout, &gr.dout) ||
      out.element_count() != q.element_count() || dout.element_count() != q.element_count())
    return ffi::Error::InvalidArgument("self_attention_grad: out and dout shaped like q");
  gr.lse = lse.typed_data();
  gr.dq = dq->typed_data();
  gr.dk = dk->typed_data();
  gr.dv = dv->typed_data();
  gr.dsinks = dsinks->typed_data();
  gpt_oss_cpu::run_items(pool, p.items(), [p, gr](int item) { backward_item(p, gr, item); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssSelfAttention, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [b, s, n, h]
                                  .Arg<ffi::AnyBuffer>()         // k [b, s, kh, h]
                                  .Arg<ffi::AnyBuffer>()         // v [b, s, kh, h]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [n]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos [b, s]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seg [b, s]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [b, s, n, h]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [b, n, s]
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssSelfAttentionGrad, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seg
                                  .Arg<ffi::AnyBuffer>()         // out [b, s, n, h]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse [b, n, s]
                                  .Arg<ffi::AnyBuffer>()         // dout [b, s, n, h]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dsinks [b, n]
                                  .Attr<int64_t>("window"));
