// layer_norm (centred) and rms_norm over rows of length `cols`, statistics in float.
//
// Forward: a warp per row (short rows) or a block per row; the row is read from global memory once into
// registers (up to 4 vectors of 16 bytes per thread), the mean and then the centred variance are reduced from
// there (two exact passes over registers, no E[x^2] - E[x]^2 cancellation), and y is written with 16-byte
// stores. It also writes the per-row mean (layer norm) and rstd, float32, for the backward.
//
// Backward: dx = rstd * (g*w - x_hat * mean(g*w*x_hat) - mean(g*w)) (the last term for layer norm only), and
// dw = sum over rows of g * x_hat, db = sum of g. A persistent grid: each block walks rows, keeping g and x of
// a row in registers, and sums dw, db of its columns in shared memory (a thread owns its columns: no atomics,
// no barrier in the loop); then one float32 row of partial sums per block, added up by column_sums.
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

template <typename T, int N, int NV, bool kWarp>
__global__ void __launch_bounds__(1024, 1)
    norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                        float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int cols, float eps) {
  __shared__ float scratch[32];
  const RowGroup<kWarp> g;
  const bool centred = mean_out != nullptr;
  const int vecs = cols / N;
  const float inv_cols = 1.f / cols;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const T* xr = x + row * cols;
    float v[NV > 0 ? NV : 1][N];
    float s = 0.f;
    if (NV > 0 || centred)
      for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
        load<T, N>(xr + c * N, v[j]);
#pragma unroll
        for (int k = 0; k < N; ++k) s += v[j][k];
      });
    const float mean = centred ? g.sum(s, scratch) * inv_cols : 0.f;
    float sq = 0.f;
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      if (NV == 0) load<T, N>(xr + c * N, v[j]);
#pragma unroll
      for (int k = 0; k < N; ++k) sq += (v[j][k] - mean) * (v[j][k] - mean);
    });
    const float rstd = rsqrtf(g.sum(sq, scratch) * inv_cols + eps);
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      if (NV == 0) load<T, N>(xr + c * N, v[j]);
      float wv[N], bv[N] = {}, out[N];
      load<T, N>(w + c * N, wv);
      if (b) load<T, N>(b + c * N, bv);
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = (v[j][k] - mean) * rstd * wv[k] + bv[k];
      store<T, N>(y + row * cols + c * N, out);
    });
    if (g.rank == 0) {
      if (centred) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

template <typename T, int N, int NV, bool kWarp>
__global__ void __launch_bounds__(1024, 1)
    norm_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x, const T* __restrict__ w,
                         const float* __restrict__ mean_in, const float* __restrict__ rstd_in, T* __restrict__ dx,
                         float* __restrict__ partial, int64_t rows, int cols) {
  extern __shared__ float4 smem[];
  __shared__ float scratch[32];
  const RowGroup<kWarp> g;
  const bool centred = mean_in != nullptr;
  const int nacc = centred ? 2 : 1, vecs = cols / N;
  float* acc_w = reinterpret_cast<float*>(smem) + (kWarp ? threadIdx.x / 32 : 0) * nacc * cols;
  float* acc_b = acc_w + cols;
  zero_owned<kWarp>(acc_w, nacc * cols);
  const float inv_cols = 1.f / cols;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const T *gr = grad + row * cols, *xr = x + row * cols;
    const float mean = centred ? mean_in[row] : 0.f, rstd = rstd_in[row];
    float gv[NV > 0 ? NV : 1][N], xv[NV > 0 ? NV : 1][N];
    float sum_gw = 0.f, sum_gwx = 0.f;  // sums of g*w and of g*w*x_hat over the row
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      float wv[N];
      load<T, N>(gr + c * N, gv[j]);
      load<T, N>(xr + c * N, xv[j]);
      load<T, N>(w + c * N, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float gw = gv[j][k] * wv[k];
        sum_gw += gw;
        sum_gwx += gw * (xv[j][k] - mean) * rstd;
      }
    });
    const float mean_gwx = g.sum(sum_gwx, scratch) * inv_cols;
    const float mean_gw = centred ? g.sum(sum_gw, scratch) * inv_cols : 0.f;
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      if (NV == 0) {
        load<T, N>(gr + c * N, gv[j]);
        load<T, N>(xr + c * N, xv[j]);
      }
      float wv[N], out[N], dw[N];
      load<T, N>(w + c * N, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float x_hat = (xv[j][k] - mean) * rstd;
        out[k] = rstd * (gv[j][k] * wv[k] - x_hat * mean_gwx - mean_gw);
        dw[k] = gv[j][k] * x_hat;
      }
      store<T, N>(dx + row * cols + c * N, out);
      add_to<N>(acc_w + c * N, dw);
      if (centred) add_to<N>(acc_b + c * N, gv[j]);
    });
  }
  write_partials<kWarp>(reinterpret_cast<float*>(smem), nacc, cols, partial);
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

// b == nullptr and mean == nullptr: rms_norm; otherwise layer_norm.
cudaError_t sbp_norm_forward(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                             int64_t rows, int64_t cols, float eps, int dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool aligned = aligned16(x) && aligned16(w) && aligned16(b) && aligned16(y);
    const RowPlan plan = plan_rows(cols, kVec<T>, aligned, 4, 4);
    dispatch_shape<T, 4>(plan, [&](auto shape) {
      using S = decltype(shape);
      norm_forward_kernel<T, S::N, S::NV, S::kWarp><<<blocks_for(rows, plan.rows_per_block()), plan.threads, 0, stream>>>(
          (const T*)x, (const T*)w, (const T*)b, (T*)y, mean, rstd, rows, (int)cols, eps);
    });
  });
}

cudaError_t sbp_norm_backward(const void* grad, const void* x, const void* w, const float* mean, const float* rstd,
                              void* dx, void* dw, void* db, float* partial, int64_t rows, int64_t cols, int dtype,
                              int sm_count, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;  // the caller gives zero dw, db for no rows
  cudaError_t err = cudaSuccess;
  int parts = 0;
  const cudaError_t launch = dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool aligned = aligned16(grad) && aligned16(x) && aligned16(w) && aligned16(dx);
    const RowPlan plan = plan_rows(cols, kVec<T>, aligned, 2, 2);
    dispatch_shape<T, 2>(plan, [&](auto shape) {
      using S = decltype(shape);
      const auto kernel = norm_backward_kernel<T, S::N, S::NV, S::kWarp>;
      const ReduceLaunch rl = plan_reduce((const void*)kernel, plan, mean ? 2 : 1, rows, cols, sm_count,
                                          max_partial_rows(rows, sm_count));
      if ((err = rl.err) != cudaSuccess) return;
      kernel<<<rl.grid, plan.threads, rl.smem, stream>>>((const T*)grad, (const T*)x, (const T*)w, mean, rstd, (T*)dx,
                                                        partial, rows, (int)cols);
      parts = (int)rl.grid;
    });
  });
  if (err != cudaSuccess) return err;
  if (launch != cudaSuccess) return launch;
  return column_sums(partial, parts, cols, dw, mean ? db : nullptr, dtype, stream);
}
