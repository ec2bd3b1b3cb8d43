// scale_mask_softmax over rows of length `cols`: y = softmax(x * scale) with positions where mask != 0 (mask
// rows repeat every `mask_rows` rows: a broadcast mask) or, causal, key j > query (row % queries) excluded.
// One block per row, three passes over the row (max, sum, write); backward: dx = scale * y * (g - sum(g * y)).
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

__device__ __forceinline__ bool excluded(const uint8_t* mask, int64_t row, int64_t col, int64_t cols,
                                         int64_t mask_rows, int64_t queries) {
  if (mask && mask[(row % mask_rows) * cols + col]) return true;
  return queries > 0 && col > row % queries;
}

template <typename T>
__global__ void softmax_kernel(const T* x, const uint8_t* mask, T* y, int64_t cols, int64_t mask_rows,
                               int64_t queries, float scale) {
  __shared__ float scratch[kBlock / 32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    if (!excluded(mask, row, c, cols, mask_rows, queries)) m = fmaxf(m, to_float(xr[c]) * scale);
  m = block_reduce<true>(m, scratch);
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    if (!excluded(mask, row, c, cols, mask_rows, queries)) s += expf(to_float(xr[c]) * scale - m);
  s = block_reduce<false>(s, scratch);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    // a fully excluded row gives NaN (0 / 0), as masked_fill(-inf) + softmax does
    float v = excluded(mask, row, c, cols, mask_rows, queries) ? 0.f : expf(to_float(xr[c]) * scale - m);
    y[row * cols + c] = from_float<T>(v / s);
  }
}

template <typename T>
__global__ void softmax_backward_kernel(const T* grad, const T* y, T* dx, int64_t cols, float scale) {
  __shared__ float scratch[kBlock / 32];
  const int64_t base = (int64_t)blockIdx.x * cols;
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += to_float(grad[base + c]) * to_float(y[base + c]);
  dot = block_reduce<false>(dot, scratch);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dx[base + c] = from_float<T>(scale * to_float(y[base + c]) * (to_float(grad[base + c]) - dot));
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

// mask: nullptr or uint8 [mask_rows, cols]; queries: 0 (not causal) or the size of the query dim.
cudaError_t sbp_scale_mask_softmax(const void* x, const uint8_t* mask, void* y, int64_t rows, int64_t cols,
                                   int64_t mask_rows, int64_t queries, float scale, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_kernel<T><<<(unsigned)rows, kBlock, 0, stream>>>((const T*)x, mask, (T*)y, cols, mask_rows, queries, scale);
  });
}

cudaError_t sbp_scale_mask_softmax_backward(const void* grad, const void* y, void* dx, int64_t rows, int64_t cols,
                                            float scale, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_backward_kernel<T><<<(unsigned)rows, kBlock, 0, stream>>>((const T*)grad, (const T*)y, (T*)dx, cols, scale);
  });
}
