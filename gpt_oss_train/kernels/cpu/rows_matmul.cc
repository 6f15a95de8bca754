// A few rows times one layer of a layer-stacked float32 or bfloat16 matrix,
// x [M, K] @ w[layer] with w [L, K, N] -> float32 [M, N], as one XLA FFI custom call: a
// decode step's attention projections (read in place from the stacked parameters, like
// the experts) and its unembedding (L = 1).
//
// Why a kernel: XLA:CPU's dot at 2-16 rows reads a large matrix at a fraction of the
// memory bandwidth (a [16, 768] x [768, 32768] product 6x slower than its bytes allow,
// docs/PERFORMANCE.md), and a layer slice of a scanned stack is copied before XLA's dot
// reads it. Here the threads of the intra-op pool share blocks of the matrix.

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "stream_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Work items: blocks of contraction rows x blocks of columns, so each item reads long
// contiguous runs of the weights (whole rows of a narrow projection, 2 KB runs of the
// unembedding) and there are at least 4 items per thread. Items of different depth blocks
// write partial products, summed by the caller at the end.
struct Job {
  int m, k, n;
  int col_block, col_blocks, depth_block, depth_blocks;
  gpt_oss_cpu::Weights w;  // the layer's matrix
  float* out;
  std::unique_ptr<float[]> partial;  // [depth_blocks][m][n], where depth_blocks > 1
  std::vector<const float*> rows;
  std::atomic<int> next{0}, done{0};
  int items() const { return col_blocks * depth_blocks; }
};

void plan(Job& j, int threads) {
  constexpr int kWideCols = 4096, kMinDepth = 64;
  j.col_block = j.n <= 2 * kWideCols ? j.n : kWideCols;
  j.col_blocks = (j.n + j.col_block - 1) / j.col_block;
  const int wanted = (4 * threads + j.col_blocks - 1) / j.col_blocks;
  const int most = std::max(1, j.k / kMinDepth);
  j.depth_blocks = std::min(wanted, most);
  const int step = gpt_oss_cpu::kDepthStep;
  j.depth_block = ((j.k + j.depth_blocks - 1) / j.depth_blocks + step - 1) / step * step;
  j.depth_blocks = (j.k + j.depth_block - 1) / j.depth_block;
}

void work(Job& j) {
  for (int i; (i = j.next.fetch_add(1)) < j.items();) {
    const int db = i / j.col_blocks, c0 = (i % j.col_blocks) * j.col_block;
    const int d0 = db * j.depth_block, d1 = std::min(j.k, d0 + j.depth_block);
    const int cols = std::min(j.n - c0, j.col_block);
    std::vector<const float*> rows(j.m);
    for (int r = 0; r < j.m; ++r) rows[r] = j.rows[r] + d0;
    float* out = j.depth_blocks > 1 ? j.partial.get() + size_t(db) * j.m * j.n : j.out;
    gpt_oss_cpu::matmul_rows(rows.data(), j.m, j.w, int64_t(d0) * j.n + c0, j.n,
                             d1 - d0, cols, out + c0, j.n);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_matmul: x [M, K] and w [L, K, N]");
  const int l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("rows_matmul: layer out of range");
  auto job = std::make_shared<Job>();
  job->m = int(xd[0]);
  job->k = int(xd[1]);
  job->n = int(wd[2]);
  if (!gpt_oss_cpu::as_weights(w, &job->w))
    return ffi::Error::InvalidArgument("rows_matmul: w must be float32 or bfloat16");
  job->w = job->w.from(int64_t(l) * job->k * job->n);
  job->out = out->typed_data();
  plan(*job, std::max(1, int(pool.num_threads())));
  const size_t size = size_t(job->m) * job->n;
  if (job->depth_blocks > 1) job->partial.reset(new float[job->depth_blocks * size]);
  for (int r = 0; r < job->m; ++r) job->rows.push_back(x.typed_data() + size_t(r) * job->k);
  gpt_oss_cpu::run_on_pool(pool, [job] { work(*job); }, [&] {
    return job->done.load(std::memory_order_acquire) >= job->items();
  });
  if (job->depth_blocks > 1) {  // a few hundred KB at most: the caller sums the partials
    const float* p = job->partial.get();
    std::copy(p, p + size, job->out);
    for (int b = 1; b < job->depth_blocks; ++b)
      for (size_t i = 0; i < size; ++i) job->out[i] += p[b * size + i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [L, K, N], F32 or BF16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
