// Row-stationary float32 products for the CPU: y[M, N] = x[M, K] @ W for the few rows a verification
// multiplies (pallas_kernels/cpu_rows/__init__.py says why). W comes as panels [N / 64, K, 64], laid out
// once offline, so each column block streams its K x 64 values contiguously and every value read is used
// for every row. Each output sums over k in one fixed order whatever M is: a row's result does not depend
// on how many rows share the call. Column blocks are split over XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

constexpr int64_t kCols = 64;  // columns per panel: 4 vectors of 16
constexpr int64_t kRows = 8;   // rows per tile: 8 x 4 accumulators
constexpr int64_t kAhead = 32;  // panel rows prefetched ahead (8 KB): the stream overlaps the FMAs

// y[m0:m0+MT, n0:n0+kCols] from one panel [K, kCols].
template <int MT>
void panel_block(const float* x, const float* panel, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  v16 acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    const float* wr = panel + k * kCols;
    __builtin_prefetch(wr + kAhead * kCols);
    __builtin_prefetch(wr + kAhead * kCols + 16);
    __builtin_prefetch(wr + kAhead * kCols + 32);
    __builtin_prefetch(wr + kAhead * kCols + 48);
    v16 w0 = load(wr), w1 = load(wr + 16), w2 = load(wr + 32), w3 = load(wr + 48);
    for (int m = 0; m < MT; ++m) {
      float xv = x[(m0 + m) * K + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
      acc[m][2] += xv * w2;
      acc[m][3] += xv * w3;
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) store(y + (m0 + m) * N + n0 + 16 * j, acc[m][j]);
}

void panel_columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t b0,
                   int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* panel = w + b * K * kCols;
    int64_t n0 = b * kCols;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      switch (std::min<int64_t>(kRows, M - m0)) {
        case 1: panel_block<1>(x, panel, y, K, N, m0, n0); break;
        case 2: panel_block<2>(x, panel, y, K, N, m0, n0); break;
        case 3: panel_block<3>(x, panel, y, K, N, m0, n0); break;
        case 4: panel_block<4>(x, panel, y, K, N, m0, n0); break;
        case 5: panel_block<5>(x, panel, y, K, N, m0, n0); break;
        case 6: panel_block<6>(x, panel, y, K, N, m0, n0); break;
        case 7: panel_block<7>(x, panel, y, K, N, m0, n0); break;
        default: panel_block<8>(x, panel, y, K, N, m0, n0); break;
      }
    }
  }
}

// Chunks of [0, total) claimed by whoever is free: the caller and the pool's tasks. The caller can
// finish every chunk itself, so a pool with no free thread makes it slower, never stuck.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t chunks = 0, total = 0;
};

template <typename F>
void parallel(ffi::ThreadPool& pool, int64_t total, int64_t grain, F body) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunks = std::min<int64_t>((total + grain - 1) / grain, 4 * threads);
  if (chunks <= 1 || threads == 1) {
    body(0, total);
    return;
  }
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  work->total = total;
  auto run = [work, body]() {
    for (;;) {
      int64_t c = work->next.fetch_add(1);
      if (c >= work->chunks) return;
      body(c * work->total / work->chunks, (c + 1) * work->total / work->chunks);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  while (work->done.load(std::memory_order_acquire) < chunks) {
  }
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("rows_matmul takes x [M, K], panels [N / 64, K, 64], y [M, N]");
  int64_t M = xd[0], K = xd[1], N = yd[1];
  if (wd[0] * kCols != N || wd[1] != K || wd[2] != kCols || yd[0] != M)
    return ffi::Error::InvalidArgument("rows_matmul: the panels' shape does not match x and y");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  parallel(pool, N / kCols, 4, [=](int64_t a, int64_t b) { panel_columns(xp, wp, yp, M, K, N, a, b); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecpilotRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
