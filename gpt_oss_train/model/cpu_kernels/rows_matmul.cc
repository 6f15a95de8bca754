// A few rows times a large float32 matrix, x [M, K] @ w [K, N] -> [M, N], as one XLA FFI
// custom call: the unembedding of a decode step (M = batch).
//
// Why a kernel: XLA:CPU's dot at 2-16 rows reads a large matrix at a fraction of the
// memory bandwidth (a [16, 768] x [768, 32768] product 6x slower than its bytes allow,
// docs/PERFORMANCE.md), where one row runs at the bandwidth. Here the threads of the
// intra-op pool each stream blocks of columns, kRowBlock rows per pass.

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "stream_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kItemCols = 512;  // columns per work item: 2 KB runs of each weight row

struct Job {
  int m, k, n;
  const float* w;
  float* out;
  std::vector<const float*> rows;
  std::atomic<int> next{0}, done{0};
};

void work(Job& j) {
  const int items = (j.n + kItemCols - 1) / kItemCols;
  for (int i; (i = j.next.fetch_add(1)) < items;) {
    const int c0 = i * kItemCols, c1 = std::min(j.n, c0 + kItemCols);
    gpt_oss_cpu::matmul_rows(j.rows.data(), j.m, j.w + c0, j.n, j.k, c1 - c0, j.out + c0, j.n);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("rows_matmul: x [M, K] and w [K, N]");
  auto job = std::make_shared<Job>();
  job->m = int(xd[0]);
  job->k = int(xd[1]);
  job->n = int(wd[1]);
  job->w = w.typed_data();
  job->out = out->typed_data();
  for (int r = 0; r < job->m; ++r) job->rows.push_back(x.typed_data() + size_t(r) * job->k);
  const int helpers = std::max(0, int(pool.num_threads()) - 1);
  for (int i = 0; i < helpers; ++i) pool.Schedule([job] { work(*job); });
  work(*job);
  const int items = (job->n + kItemCols - 1) / kItemCols;
  while (job->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptOssRowsMatmulF32, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
