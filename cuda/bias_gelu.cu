// bias_gelu: y = gelu(x + bias[col]) over rows of `cols` features; backward gives d(x + bias).
// The bias gradient (a column sum of grad_x) is left to the caller's reduction.
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

__device__ __forceinline__ float gelu(float z, bool tanh_approx, float* derivative) {
  if (tanh_approx) {
    const float k = 0.7978845608028654f, c = 0.044715f;
    float inner = k * (z + c * z * z * z), t = tanhf(inner);
    *derivative = 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * k * (1.f + 3.f * c * z * z);
    return 0.5f * z * (1.f + t);
  }
  float cdf = 0.5f * (1.f + erff(z * 0.7071067811865476f));
  *derivative = cdf + z * 0.3989422804014327f * expf(-0.5f * z * z);
  return z * cdf;
}

template <typename T>
__global__ void bias_gelu_kernel(const T* x, const T* bias, const T* grad, T* out, int64_t n, int64_t cols,
                                 bool tanh_approx) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float d, y = gelu(to_float(x[i]) + to_float(bias[i % cols]), tanh_approx, &d);
    out[i] = from_float<T>(grad ? to_float(grad[i]) * d : y);
  }
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

// grad == nullptr: forward (out = y); else backward (out = grad * gelu'(x + bias)).
cudaError_t sbp_bias_gelu(const void* x, const void* bias, const void* grad, void* out, int64_t n, int64_t cols,
                          bool tanh_approx, int dtype, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_gelu_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream>>>(
        (const T*)x, (const T*)bias, (const T*)grad, (T*)out, n, cols, tanh_approx);
  });
}
