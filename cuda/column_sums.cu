// The second stage of the column reductions (bias, weight gradients), and the launch helpers of common.cuh.
//
// A backward that reduces over rows (dbias of bias_gelu and bias_dropout_add; dweight, dbias of the norms)
// runs a persistent grid: each block walks many rows, summing its columns in shared memory, and writes one
// float32 row of partial sums. column_sums adds those rows up in a fixed order and writes the parameter's
// dtype. Two launches, no atomics: the gradients are bitwise reproducible, and no N x H temporary exists.
#include <map>
#include <mutex>
#include <tuple>

#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

namespace {

constexpr int kColumns = 32, kSlices = 8;  // a block sums 32 columns, 8 threads down each

template <typename T>
__global__ void column_sums_kernel(const float* __restrict__ partial, int parts, int64_t cols, T* __restrict__ out_a,
                                   T* __restrict__ out_b) {
  __shared__ float sums[kSlices][kColumns + 1];
  const int64_t col = (int64_t)blockIdx.x * kColumns + threadIdx.x;
  const float* rows = partial + (int64_t)blockIdx.y * parts * cols;  // blockIdx.y: output a or b
  float s = 0.f;
  if (col < cols)
    for (int p = threadIdx.y; p < parts; p += kSlices) s += rows[p * cols + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int k = 1; k < kSlices; ++k) s += sums[k][threadIdx.x];
    (blockIdx.y ? out_b : out_a)[col] = from_float<T>(s);
  }
}

}  // namespace

cudaError_t column_sums(const float* partial, int parts, int64_t cols, void* out_a, void* out_b, int dtype,
                        cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const dim3 grid(blocks_for(cols, kColumns), out_b ? 2 : 1), block(kColumns, kSlices);
    column_sums_kernel<T><<<grid, block, 0, stream>>>(partial, parts, cols, (T*)out_a, (T*)out_b);
  });
}

int resident_blocks(const void* kernel, int threads, int smem, int sm_count) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int>, int> cache;  // a few entries per kernel in practice
  std::lock_guard<std::mutex> guard(lock);
  auto key = std::make_tuple(kernel, threads, smem);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
      (void)cudaGetLastError();  // a launch with the failing configuration reports the error instead
      per_sm = 1;
    }
    it = cache.emplace(key, per_sm < 1 ? 1 : per_sm).first;
  }
  return it->second * sm_count;
}

cudaError_t allow_large_smem(const void* kernel) {
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, bool> done;
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> guard(lock);
  if (done.count({kernel, device})) return cudaSuccess;
  // The opt-in limit covers static and dynamic shared memory together: asking for all of it as dynamic memory of a
  // kernel that has static shared memory (its block-reduction scratch) is an invalid value.
  cudaFuncAttributes attributes;
  err = cudaFuncGetAttributes(&attributes, kernel);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             optin - (int)attributes.sharedSizeBytes);
  if (err == cudaSuccess) done[{kernel, device}] = true;
  return err;
}

}  // namespace sbp_kernels

int64_t sbp_reduce_partials(int64_t rows, int sm_count) { return sbp_kernels::max_partial_rows(rows, sm_count); }
