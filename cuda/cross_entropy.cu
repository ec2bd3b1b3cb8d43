// cross_entropy over rows of `classes` logits, one block per row, one pass with an online max / sum-exp
// (never a softmax in memory). Forward writes each row's loss (0 where target == ignore_index) and its
// log-sum-exp; backward writes dlogits = (exp(logit - lse) - onehot) * row_weight[row].
// `first_class` is the first class held here (vocabulary-parallel: targets outside the slice pick nothing;
// the caller combines the per-rank max / sum-exp / picked logit across ranks before the loss).
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

constexpr int kBlock = 256;  // threads per block (one block per row)

template <typename T>
__global__ void ce_forward_kernel(const T* logits, const int64_t* target, float* row_max, float* row_sum_exp,
                                  float* row_picked, int64_t classes, int64_t first_class) {
  __shared__ float scratch[kBlock / 32];
  const int64_t row = blockIdx.x, base = row * classes;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
    float v = to_float(logits[base + c]);
    if (v > m) { s = s * expf(m - v) + 1.f; m = v; } else { s += expf(v - m); }
  }
  const float block_m = block_reduce<true>(m, scratch);
  s = m == -INFINITY ? 0.f : s * expf(m - block_m);
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) {
    int64_t t = target[row] - first_class;
    row_max[row] = block_m;
    row_sum_exp[row] = s;
    row_picked[row] = (t >= 0 && t < classes) ? to_float(logits[base + t]) : 0.f;
  }
}

template <typename T>
__global__ void ce_backward_kernel(const T* logits, const int64_t* target, const float* lse, const float* weight,
                                   T* dlogits, int64_t classes, int64_t first_class) {
  const int64_t row = blockIdx.x, base = row * classes, t = target[row] - first_class;
  const float w = weight[row], l = lse[row];
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
    float g = expf(to_float(logits[base + c]) - l) - (c == t ? 1.f : 0.f);
    dlogits[base + c] = from_float<T>(g * w);
  }
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

// Per row: max, sum of exp(logit - max), and the target's logit (0 if not held here); all float32.
cudaError_t sbp_cross_entropy_stats(const void* logits, const int64_t* target, float* row_max, float* row_sum_exp,
                                    float* row_picked, int64_t rows, int64_t classes, int64_t first_class, int dtype,
                                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    ce_forward_kernel<T><<<(unsigned)rows, kBlock, 0, stream>>>((const T*)logits, target, row_max, row_sum_exp,
                                                              row_picked, classes, first_class);
  });
}

cudaError_t sbp_cross_entropy_backward(const void* logits, const int64_t* target, const float* lse,
                                       const float* row_weight, void* dlogits, int64_t rows, int64_t classes,
                                       int64_t first_class, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    ce_backward_kernel<T><<<(unsigned)rows, kBlock, 0, stream>>>((const T*)logits, target, lse, row_weight,
                                                               (T*)dlogits, classes, first_class);
  });
}
