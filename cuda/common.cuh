// Shared by the fused kernels: dtype tags, float conversion, block reductions, the entry-point convention.
// Entry points are plain C++ functions taking device pointers, sizes, a dtype tag and a cudaStream_t; they
// return cudaGetLastError() so the caller (csrc/, torch-facing) turns a launch failure into an exception.
// No torch headers here: CI compiles every .cu with `nvcc -c` on a machine without torch's CUDA build.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace sbp_kernels {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

constexpr int kBlock = 256;  // threads per block of the row kernels (a multiple of 32)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over the block; every thread gets the result. `scratch` holds kBlock / 32 floats.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float identity = kMax ? -INFINITY : 0.0f;
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? scratch[lane] : identity;
    v = kMax ? warp_max(v) : warp_sum(v);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();  // every warp reads the total: warp 0 alone had it (found on an H100, rows over 32 long)
  return scratch[0];
}

// Calls f.template operator()<T>() for the dtype tag; unknown tags return cudaErrorInvalidValue.
template <typename F>
cudaError_t dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f((float*)nullptr); break;
    case kFloat16: f((__half*)nullptr); break;
    case kBFloat16: f((__nv_bfloat16*)nullptr); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

inline unsigned grid_for(int64_t n, int block) {
  int64_t g = (n + block - 1) / block;
  return (unsigned)(g < 65535 * 32 ? (g > 0 ? g : 1) : 65535 * 32);
}

}  // namespace sbp_kernels
