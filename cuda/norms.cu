// layer_norm (centred) and rms_norm over rows of length `cols`, one block per row, statistics in float.
// Forward writes y and the per-row mean (layer norm) and rstd for the backward; backward writes dx per row
// and, per row, g * x_hat into `partial_w` (and g into `partial_b`) for the caller to sum over rows.
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

template <typename T>
__global__ void norm_kernel(const T* x, const T* w, const T* b, T* y, float* mean_out, float* rstd_out,
                            int64_t cols, float eps, bool centred) {
  __shared__ float scratch[kBlock / 32];
  const int64_t base = (int64_t)blockIdx.x * cols;
  float mean = 0.f;
  if (centred) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) mean += to_float(x[base + c]);
    mean = block_reduce<false>(mean, scratch) / cols;
  }
  float sq = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float d = to_float(x[base + c]) - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(block_reduce<false>(sq, scratch) / cols + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = (to_float(x[base + c]) - mean) * rstd * to_float(w[c]);
    y[base + c] = from_float<T>(b ? v + to_float(b[c]) : v);
  }
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

template <typename T>
__global__ void norm_backward_kernel(const T* grad, const T* x, const T* w, const float* mean_in, const float* rstd_in,
                                     T* dx, float* partial_w, float* partial_b, int64_t cols) {
  __shared__ float scratch[kBlock / 32];
  const int64_t row = blockIdx.x, base = row * cols;
  const float mean = mean_in ? mean_in[row] : 0.f, rstd = rstd_in[row];
  float sum_g = 0.f, sum_gx = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float gxh = to_float(grad[base + c]) * to_float(w[c]), xh = (to_float(x[base + c]) - mean) * rstd;
    sum_g += gxh;
    sum_gx += gxh * xh;
  }
  sum_g = block_reduce<false>(sum_g, scratch) / cols;
  sum_gx = block_reduce<false>(sum_gx, scratch) / cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float g = to_float(grad[base + c]), xh = (to_float(x[base + c]) - mean) * rstd;
    float inner = g * to_float(w[c]) - xh * sum_gx - (mean_in ? sum_g : 0.f);
    dx[base + c] = from_float<T>(rstd * inner);
    partial_w[base + c] = g * xh;
    if (partial_b) partial_b[base + c] = g;
  }
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

// b == nullptr and mean == nullptr: rms_norm; otherwise layer_norm.
cudaError_t sbp_norm_forward(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                             int64_t rows, int64_t cols, float eps, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    norm_kernel<T><<<(unsigned)rows, kBlock, 0, stream>>>((const T*)x, (const T*)w, (const T*)b, (T*)y, mean, rstd,
                                                        cols, eps, mean != nullptr);
  });
}

cudaError_t sbp_norm_backward(const void* grad, const void* x, const void* w, const float* mean, const float* rstd,
                              void* dx, float* partial_w, float* partial_b, int64_t rows, int64_t cols, int dtype,
                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    norm_backward_kernel<T><<<(unsigned)rows, kBlock, 0, stream>>>((const T*)grad, (const T*)x, (const T*)w, mean,
                                                                 rstd, (T*)dx, partial_w, partial_b, cols);
  });
}
