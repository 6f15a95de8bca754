// Attention of a decode step's few queries over one layer of the stacked KV cache, as one
// XLA FFI custom call, reading the keys and values in place in their stored layout
// (float32 or bfloat16, widened as they are read; the arithmetic is float32).
//
// Why a kernel: XLA's attention over the cache (xla/attention.py, cache_attention) makes
// XLA:CPU copy the layer's keys and values out of the stack and transpose them to
// [batch, kv_heads, slots, head_dim] before its small batched dots, every step and layer;
// at batch 16 that was ~30 ms of a ~160 ms step (docs/PERFORMANCE.md). The arithmetic is
// small; the cost is memory traffic and per-op overhead.
//
// Semantics (gpt-oss, as xla_attention): grouped-query attention with one sink logit per
// query head in the softmax denominator only; key slot j is visible to query i when
// 0 <= pos_j <= pos_i and (banded layers) pos_i - pos_j < window. A query that sees no
// key gets 0.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "stream_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Job {
  int b, s, n, kh, g, h, t;
  int64_t window;  // 0: none
  float scale;
  const float *q, *sinks;
  gpt_oss_cpu::Weights k, v;  // the layer's keys and values, float32 or bfloat16
  const int32_t *q_pos, *k_pos;
  float* out;
  std::atomic<int> next{0}, done{0};
  int items() const { return b * kh; }
};

template <class T>
inline float dot(const float* a, const T* b, int n) {
  using gpt_oss_cpu::load8;
  using gpt_oss_cpu::widen;
  gpt_oss_cpu::v8f acc = {};
  int x = 0;
  for (; x + 8 <= n; x += 8) acc += load8(a + x) * load8(b + x);
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += acc[i];
  for (; x < n; ++x) sum += a[x] * widen(b[x]);
  return sum;
}

// Each item reads its head's keys and values as short runs (h elements) one slot apart
// (kh * h elements), which the hardware prefetchers do not follow; a step's cache is
// evicted from L3 by the weights the step streams. So the rows kAhead slots on are
// prefetched by hand (docs/PERFORMANCE.md, "CPU kernels").
constexpr int kAhead = 8;

template <class T>
inline void prefetch_row(const T* row, int h) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int b = 0; b < h * int(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 1);
}

// One (batch row, KV head): its g query heads for each of the s queries. Each key and
// value row is read once for all g heads. T: the cache's element type.
template <class T>
void attend(const Job& j, int row, int kvh) {
  using gpt_oss_cpu::widen;
  const int64_t kv_row = int64_t(j.kh) * j.h;  // elements from one slot to the next
  const int64_t at = int64_t(row) * j.t * kv_row + int64_t(kvh) * j.h;
  const T* k0 = j.k.at<T>(at);
  const T* v0 = j.v.at<T>(at);
  const int32_t* kp = j.k_pos + int64_t(row) * j.t;
  std::vector<float> weight(size_t(j.g) * j.t), denom(j.g), top(j.g), acc(size_t(j.g) * j.h);
  std::vector<char> seen(j.t);
  for (int qi = 0; qi < j.s; ++qi) {
    const int64_t p = j.q_pos[int64_t(row) * j.s + qi];
    const float* q = j.q + ((int64_t(row) * j.s + qi) * j.n + int64_t(kvh) * j.g) * j.h;
    for (int gi = 0; gi < j.g; ++gi) top[gi] = j.sinks[kvh * j.g + gi];
    for (int t = 0; t < j.t; ++t) {
      prefetch_row(k0 + (t + kAhead) * kv_row, j.h);
      const int64_t kpos = kp[t];
      seen[t] = kpos >= 0 && kpos <= p && (j.window == 0 || p - kpos < j.window);
      if (!seen[t]) continue;
      for (int gi = 0; gi < j.g; ++gi) {
        const float logit = dot(q + gi * j.h, k0 + t * kv_row, j.h) * j.scale;
        weight[size_t(gi) * j.t + t] = logit;
        top[gi] = std::max(top[gi], logit);
      }
    }
    for (int gi = 0; gi < j.g; ++gi) denom[gi] = std::exp(j.sinks[kvh * j.g + gi] - top[gi]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int t = 0; t < j.t; ++t) {
      prefetch_row(v0 + (t + kAhead) * kv_row, j.h);
      if (!seen[t]) continue;
      const T* vr = v0 + t * kv_row;
      for (int gi = 0; gi < j.g; ++gi) {
        const float w = std::exp(weight[size_t(gi) * j.t + t] - top[gi]);
        denom[gi] += w;
        float* a = acc.data() + size_t(gi) * j.h;
        for (int x = 0; x < j.h; ++x) a[x] += w * widen(vr[x]);
      }
    }
    float* o = j.out + ((int64_t(row) * j.s + qi) * j.n + int64_t(kvh) * j.g) * j.h;
    for (int gi = 0; gi < j.g; ++gi)
      for (int x = 0; x < j.h; ++x) o[gi * j.h + x] = acc[size_t(gi) * j.h + x] / denom[gi];
  }
}

void work(Job& j) {
  for (int i; (i = j.next.fetch_add(1)) < j.items();) {
    if (j.k.bf16)
      attend<gpt_oss_cpu::bf16>(j, i / j.kh, i % j.kh);
    else
      attend<float>(j, i / j.kh, i % j.kh);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> k_pos, ffi::Buffer<ffi::S32> q_pos,
                               ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> layer,
                               int64_t window, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = k_pos.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || pd.size() != 3 || kd[1] != qd[0] || kd[4] != qd[3] ||
      qd[2] % kd[3] != 0 || pd[0] != kd[0] || pd[1] != kd[1] || pd[2] != kd[2])
    return ffi::Error::InvalidArgument(
        "decode_attention: q [b, s, n, h], k/v [L, b, t, kh, h], k_pos [L, b, t]");
  const int l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("decode_attention: bad layer");
  auto job = std::make_shared<Job>();
  job->b = int(qd[0]);
  job->s = int(qd[1]);
  job->n = int(qd[2]);
  job->h = int(qd[3]);
  job->t = int(kd[2]);
  job->kh = int(kd[3]);
  job->g = job->n / job->kh;
  job->window = window;
  job->scale = 1.0f / std::sqrt(float(job->h));
  const int64_t layer_size = int64_t(job->b) * job->t * job->kh * job->h;
  job->q = q.typed_data();
  if (!gpt_oss_cpu::as_weights(k, &job->k) || !gpt_oss_cpu::as_weights(v, &job->v) ||
      job->k.bf16 != job->v.bf16)
    return ffi::Error::InvalidArgument("decode_attention: k and v both float32 or bfloat16");
  job->k = job->k.from(l * layer_size);
  job->v = job->v.from(l * layer_size);
  job->k_pos = k_pos.typed_data() + int64_t(l) * job->b * job->t;
  job->q_pos = q_pos.typed_data();
  job->sinks = sinks.typed_data();
  job->out = out->typed_data();
  gpt_oss_cpu::run_on_pool(pool, [job] { work(*job); }, [&] {
    return job->done.load(std::memory_order_acquire) >= job->items();
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [b, s, n, h]
                                  .Arg<ffi::AnyBuffer>()  // k [L, b, t, kh, h], F32 or BF16
                                  .Arg<ffi::AnyBuffer>()  // v [L, b, t, kh, h], as k
                                  .Arg<ffi::Buffer<ffi::S32>>()  // k_pos [L, b, t]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos [b, s]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [n]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [b, s, n, h]
