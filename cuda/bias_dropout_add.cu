// bias_dropout_add: out = (x + bias[col]) * keep * scale + residual, keep = u < 1 - p, where u is the
// uniform of the project's counter-based rule (sbp_torch/_philox.py): logical element i (row-major, offset by
// `first_index` for this rank's region start when contiguous) uses lane i % 4 of Philox4x32-10 at counter
// (offset + i / 4, 0) with key (seed lo, seed hi), top 24 (fp32), 11 (fp16) or 8 (bf16) bits scaled to [0, 1).
// `first_index` plus the row-major position inside the local block gives i only for regions that are whole
// rows of the logical tensor; other regions pass their logical indices in `indices`.
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
  for (int r = 0; r < 10; ++r) {
    if (r) { k.x += 0x9E3779B9u; k.y += 0xBB67AE85u; }
    uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

template <typename T> __device__ __forceinline__ int uniform_bits();
template <> __device__ __forceinline__ int uniform_bits<float>() { return 24; }
template <> __device__ __forceinline__ int uniform_bits<__half>() { return 11; }
template <> __device__ __forceinline__ int uniform_bits<__nv_bfloat16>() { return 8; }

template <typename T>
__device__ __forceinline__ float uniform(uint64_t i, uint64_t seed, uint64_t offset) {
  uint64_t counter = offset + i / 4;
  uint4 w = philox4x32_10(make_uint4((uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u),
                          make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
  const uint32_t j = (uint32_t)(i % 4), lane = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
  const int bits = uniform_bits<T>();
  return (float)(lane >> (32 - bits)) * ldexpf(1.f, -bits);
}

template <typename T>
__global__ void bias_dropout_add_kernel(const T* x, const T* bias, const T* residual, T* out, uint8_t* mask,
                                        const int64_t* indices, int64_t first_index, int64_t n, int64_t cols,
                                        float p, uint64_t seed, uint64_t offset) {
  const float scale = p >= 1.f ? 0.f : 1.f / (1.f - p);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t logical = indices ? (uint64_t)indices[i] : (uint64_t)(first_index + i);
    bool keep = uniform<T>(logical, seed, offset) < 1.f - p;
    mask[i] = keep;
    float v = (to_float(x[i]) + to_float(bias[i % cols])) * (keep ? scale : 0.f) + to_float(residual[i]);
    out[i] = from_float<T>(v);
  }
}

template <typename T>
__global__ void dropout_backward_kernel(const T* grad, const uint8_t* mask, T* grad_x, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    grad_x[i] = from_float<T>(mask[i] ? to_float(grad[i]) * scale : 0.f);
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

cudaError_t sbp_bias_dropout_add(const void* x, const void* bias, const void* residual, void* out, uint8_t* mask,
                                 const int64_t* indices, int64_t first_index, int64_t n, int64_t cols, float p,
                                 uint64_t seed, uint64_t offset, int dtype, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_dropout_add_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream>>>(
        (const T*)x, (const T*)bias, (const T*)residual, (T*)out, mask, indices, first_index, n, cols, p, seed,
        offset);
  });
}

cudaError_t sbp_dropout_backward(const void* grad, const uint8_t* mask, void* grad_x, int64_t n, float scale,
                                 int dtype, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dropout_backward_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream>>>((const T*)grad, mask, (T*)grad_x, n, scale);
  });
}
