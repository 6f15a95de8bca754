// Decode-time MoE layer on a CPU, as one XLA FFI custom call: float32 activations and
// arithmetic, expert matrices of float32 or bfloat16 (widened as they are read).
//
// Why a kernel: XLA:CPU copies every expert matrix it slices out of the layer-stacked
// weights before multiplying (a dynamic slice feeding a dot becomes its own buffer), and
// runs the small bias, GLU and scatter ops around the products one at a time, on one
// core. At decode sizes these cost as much as the products (docs/PERFORMANCE.md). Here
// each chosen expert's three matrices are read once, in place, from the stacks, by all
// of the intra-op thread pool's threads. Routing (top-k) stays in XLA.
//
// Computes, for the pairs (token t, choice j) with expert e = experts[t, j]:
//   gate = min(x_t Wg[layer, e] + bg[e], limit)
//   up   = clip(x_t Wu[layer, e] + bu[e], -limit, limit)
//   act  = gate * sigmoid(alpha * gate) * (up + 1)
//   out_t = sum_j weights[t, j] * (act Wo[layer, e] + bo[e])
//
// Work: the pairs are grouped by expert, and four phases run in order, each split into
// items that threads claim from a shared counter (so the caller does all the work when
// the pool is busy, and a task that starts late finds none):
//   1. (expert, block of D rows of Wg and Wu): partial gate and up over those rows;
//   2. (expert): sum of the partials, biases, GLU -> act;
//   3. (expert, block of F rows of Wo): partial act Wo over those rows;
//   4. (token): sum of the partials and bias, weighted by the routing weights.
// Splitting the contraction, not the columns, makes each item read one contiguous run
// of weight rows, which is what lets a core stream at its memory bandwidth.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "stream_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using gpt_oss_cpu::kDepthStep;
using gpt_oss_cpu::matmul_rows;

// One matrix product's rows, split into blocks of contraction rows.
struct Split {
  int depth, rows_per_block, blocks;
  Split(int depth, int min_rows) : depth(depth) {
    // about 8 blocks of at least min_rows, a multiple of kDepthStep
    const int r = std::max(min_rows, (depth + 7) / 8);
    rows_per_block = (r + kDepthStep - 1) / kDepthStep * kDepthStep;
    blocks = (depth + rows_per_block - 1) / rows_per_block;
  }
  int begin(int b) const { return b * rows_per_block; }
  int end(int b) const { return std::min(depth, (b + 1) * rows_per_block); }
};

struct Problem {
  int tokens, k, pairs, d_model, d_ff;
  const float *weights, *bg, *bu, *bo;
  gpt_oss_cpu::Weights wg, wu, wo;  // the layer's [E, ., .] experts
  float limit, alpha;
  std::vector<int> used, first, count;  // per used expert: expert, first sorted pair, pairs
  std::vector<int> sorted_pair;         // pair (t * k + j) -> its place in expert order
  std::vector<const float*> x_rows;     // sorted pair -> its token's row of x
  std::vector<const float*> act_rows;   // sorted pair -> its row of act
  // Scratch, every element written before it is read (so left uninitialized):
  std::unique_ptr<float[]> gate_up;  // [D blocks][pairs][2F] partial gate (first F) and up
  std::unique_ptr<float[]> act;      // [pairs][F]
  std::unique_ptr<float[]> y;        // [F blocks][pairs][D] partial expert outputs
  Split in_split, out_split;
  float* out;
  Problem(int d_model, int d_ff) : in_split(d_model, 128), out_split(d_ff, 128) {}
};

void gate_up_part(Problem& p, int item) {  // phase 1
  const int u = item / p.in_split.blocks, b = item % p.in_split.blocks;
  const int e = p.used[u], n = p.count[u], first = p.first[u];
  const int d0 = p.in_split.begin(b), d1 = p.in_split.end(b);
  const int64_t matrix = int64_t(p.d_model) * p.d_ff, ld = 2 * p.d_ff;
  std::vector<const float*> rows(n);
  for (int r = 0; r < n; ++r) rows[r] = p.x_rows[first + r] + d0;
  float* part = p.gate_up.get() + (size_t(b) * p.pairs + first) * ld;
  const int64_t at = e * matrix + int64_t(d0) * p.d_ff;
  matmul_rows(rows.data(), n, p.wg, at, p.d_ff, d1 - d0, p.d_ff, part, ld);
  matmul_rows(rows.data(), n, p.wu, at, p.d_ff, d1 - d0, p.d_ff, part + p.d_ff, ld);
}

void activation(Problem& p, int u) {  // phase 2
  const int e = p.used[u], n = p.count[u], first = p.first[u], f = p.d_ff;
  const size_t block = size_t(p.pairs) * 2 * f;
  for (int r = first; r < first + n; ++r) {
    float* act = p.act.get() + size_t(r) * f;
    for (int c = 0; c < f; ++c) {
      float g = p.bg[e * f + c], v = p.bu[e * f + c];
      const float* part = p.gate_up.get() + size_t(r) * 2 * f + c;
      for (int b = 0; b < p.in_split.blocks; ++b, part += block) {
        g += part[0];
        v += part[f];
      }
      g = std::min(g, p.limit);
      v = std::clamp(v, -p.limit, p.limit);
      act[c] = g / (1.0f + std::exp(-p.alpha * g)) * (v + 1.0f);
    }
  }
}

void down_part(Problem& p, int item) {  // phase 3
  const int u = item / p.out_split.blocks, b = item % p.out_split.blocks;
  const int e = p.used[u], n = p.count[u], first = p.first[u];
  const int f0 = p.out_split.begin(b), f1 = p.out_split.end(b);
  const int64_t matrix = int64_t(p.d_model) * p.d_ff;
  std::vector<const float*> rows(n);
  for (int r = 0; r < n; ++r) rows[r] = p.act_rows[first + r] + f0;
  float* part = p.y.get() + (size_t(b) * p.pairs + first) * p.d_model;
  matmul_rows(rows.data(), n, p.wo, e * matrix + int64_t(f0) * p.d_model,
              p.d_model, f1 - f0, p.d_model, part, p.d_model);
}

void combine(Problem& p, int t) {  // phase 4
  float* row = p.out + size_t(t) * p.d_model;
  std::fill(row, row + p.d_model, 0.0f);
  for (int j = 0; j < p.k; ++j) {
    const int pair = t * p.k + j, s = p.sorted_pair[pair];
    const int e = p.used[std::upper_bound(p.first.begin(), p.first.end(), s) - p.first.begin() - 1];
    const float wt = p.weights[pair];
    for (int c = 0; c < p.d_model; ++c) {
      float y = p.bo[e * p.d_model + c];
      for (int b = 0; b < p.out_split.blocks; ++b)
        y += p.y[(size_t(b) * p.pairs + s) * p.d_model + c];
      row[c] += wt * y;
    }
  }
}

struct Phases {
  static constexpr int kCount = 4;
  std::atomic<int> next[kCount] = {}, done[kCount] = {};
  int items[kCount];
};

// Claims and runs the items of each phase in turn, waiting between phases for the
// items other threads claimed; returns once the last phase has no unclaimed items.
void work(Problem& p, Phases& s) {
  for (int phase = 0; phase < Phases::kCount; ++phase) {
    if (phase > 0)
      while (s.done[phase - 1].load(std::memory_order_acquire) < s.items[phase - 1])
        std::this_thread::yield();
    for (int i; (i = s.next[phase].fetch_add(1)) < s.items[phase];) {
      switch (phase) {
        case 0: gate_up_part(p, i); break;
        case 1: activation(p, i); break;
        case 2: down_part(p, i); break;
        default: combine(p, i); break;
      }
      s.done[phase].fetch_add(1, std::memory_order_release);
    }
  }
}

ffi::Error MoeDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> experts,
                         ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer wg,
                         ffi::Buffer<ffi::F32> bg, ffi::AnyBuffer wu,
                         ffi::Buffer<ffi::F32> bu, ffi::AnyBuffer wo,
                         ffi::Buffer<ffi::F32> bo, ffi::ResultBuffer<ffi::F32> out, float limit,
                         float alpha) {
  const auto xd = x.dimensions(), ed = experts.dimensions(), gd = wg.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || gd.size() != 4 || wo.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("moe_decode: x [T, D], experts [T, k], stacks [L, E, ., .]");
  const int num_layers = int(gd[0]), num_experts = int(gd[1]);
  auto p = std::make_shared<Problem>(int(xd[1]), int(gd[3]));
  p->tokens = int(xd[0]);
  p->k = int(ed[1]);
  p->pairs = p->tokens * p->k;
  p->d_model = int(xd[1]);
  p->d_ff = int(gd[3]);
  const int l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("moe_decode: layer out of range");
  const int64_t layer_size = int64_t(num_experts) * p->d_model * p->d_ff;
  p->weights = weights.typed_data();
  if (!gpt_oss_cpu::as_weights(wg, &p->wg) || !gpt_oss_cpu::as_weights(wu, &p->wu) ||
      !gpt_oss_cpu::as_weights(wo, &p->wo))
    return ffi::Error::InvalidArgument("moe_decode: expert stacks must be float32 or bfloat16");
  p->wg = p->wg.from(l * layer_size);
  p->wu = p->wu.from(l * layer_size);
  p->wo = p->wo.from(l * layer_size);
  p->bg = bg.typed_data();
  p->bu = bu.typed_data();
  p->bo = bo.typed_data();
  p->limit = limit;
  p->alpha = alpha;
  p->out = out->typed_data();

  // Group the pairs by expert: a counting sort, stable within an expert.
  const int32_t* idx = experts.typed_data();
  std::vector<int> per_expert(num_experts, 0);
  for (int i = 0; i < p->pairs; ++i) {
    if (idx[i] < 0 || idx[i] >= num_experts)
      return ffi::Error::InvalidArgument("moe_decode: expert index out of range");
    ++per_expert[idx[i]];
  }
  std::vector<int> start(num_experts, 0);
  for (int e = 0, at = 0; e < num_experts; at += per_expert[e], ++e) {
    start[e] = at;
    if (per_expert[e]) {
      p->used.push_back(e);
      p->first.push_back(at);
      p->count.push_back(per_expert[e]);
    }
  }
  p->sorted_pair.resize(p->pairs);
  p->x_rows.resize(p->pairs);
  p->act_rows.resize(p->pairs);
  p->gate_up.reset(new float[size_t(p->in_split.blocks) * p->pairs * 2 * p->d_ff]);
  p->act.reset(new float[size_t(p->pairs) * p->d_ff]);
  p->y.reset(new float[size_t(p->out_split.blocks) * p->pairs * p->d_model]);
  for (int i = 0; i < p->pairs; ++i) {
    const int s = start[idx[i]]++;
    p->sorted_pair[i] = s;
    p->x_rows[s] = x.typed_data() + size_t(i / p->k) * p->d_model;
    p->act_rows[s] = p->act.get() + size_t(s) * p->d_ff;
  }

  // The pool's threads and this one share the items.
  auto phases = std::make_shared<Phases>();
  const int used = int(p->used.size());
  phases->items[0] = used * p->in_split.blocks;
  phases->items[1] = used;
  phases->items[2] = used * p->out_split.blocks;
  phases->items[3] = p->tokens;
  const int last = Phases::kCount - 1;
  gpt_oss_cpu::run_on_pool(pool, [p, phases] { work(*p, *phases); }, [&] {
    return phases->done[last].load(std::memory_order_acquire) >= phases->items[last];
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssMoeDecode, MoeDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // experts [T, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::AnyBuffer>()  // Wg [L, E, D, F], F32 or BF16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bg [E, F]
                                  .Arg<ffi::AnyBuffer>()  // Wu [L, E, D, F], as Wg
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bu [E, F]
                                  .Arg<ffi::AnyBuffer>()  // Wo [L, E, F, D], as Wg
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bo [E, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, D]
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha"));
