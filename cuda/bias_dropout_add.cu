// bias_dropout_add: out = (x + bias[col]) * keep * scale + residual, keep = u < threshold, where u is the
// uniform of the project's counter-based rule (sbp_torch/_layout/_philox.py): element i (row-major) uses lane
// i % 4 of Philox4x32-10 at counter (offset + i / 4, 0) with key (seed lo, seed hi), its top 24 (fp32), 11
// (fp16) or 8 (bf16) bits scaled to [0, 1). `threshold` is 1 - p rounded to the dtype, as torch compares a
// tensor with a Python float. The kernel draws the elements of the tensor it is given as a whole logical
// tensor; regions of a larger logical tensor take the reference path (sbp_torch/kernels/_rules.py).
//
// Forward: one grid-stride pass over 16-byte vectors; a vector of 4 (fp32) or 8 (fp16, bf16) elements
// starts on a multiple of 4, so it takes whole Philox outputs (one or two per vector). Backward: dx = g *
// keep * scale over rows, with dbias = the column sums of dx (shared memory per block, then column_sums).
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

__device__ __forceinline__ uint4 philox4x32_10(uint64_t counter, uint64_t seed) {
  uint4 c = make_uint4((uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u);
  uint2 k = make_uint2((uint32_t)seed, (uint32_t)(seed >> 32));
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) k.x += 0x9E3779B9u, k.y += 0xBB67AE85u;
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

template <typename T> constexpr int kUniformBits = 24;
template <> constexpr int kUniformBits<__half> = 11;
template <> constexpr int kUniformBits<__nv_bfloat16> = 8;

template <typename T>
__device__ __forceinline__ float to_uniform(uint32_t word) {
  return (float)(word >> (32 - kUniformBits<T>)) * (1.f / (float)(1u << kUniformBits<T>));
}

// The uniforms of elements first .. first + N - 1.
template <typename T, int N>
__device__ __forceinline__ void uniforms(uint64_t first, uint64_t seed, uint64_t offset, float (&u)[N]) {
  if constexpr (N % 4 == 0) {  // first is a multiple of N: whole Philox outputs
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const uint4 w = philox4x32_10(offset + (first + k) / 4, seed);
      u[k] = to_uniform<T>(w.x), u[k + 1] = to_uniform<T>(w.y), u[k + 2] = to_uniform<T>(w.z);
      u[k + 3] = to_uniform<T>(w.w);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const uint64_t i = first + k;
      const uint4 w = philox4x32_10(offset + i / 4, seed);
      const uint32_t lane = i % 4 == 0 ? w.x : i % 4 == 1 ? w.y : i % 4 == 2 ? w.z : w.w;
      u[k] = to_uniform<T>(lane);
    }
  }
}

template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* p, const bool (&b)[N]) {
  Raw<uint8_t, N> raw;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(&raw);
#pragma unroll
  for (int k = 0; k < N; ++k) bytes[k] = b[k];
  *reinterpret_cast<Raw<uint8_t, N>*>(p) = raw;
}

template <typename T, int N>
__global__ void __launch_bounds__(256)
    bias_dropout_add_kernel(const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ residual,
                            T* __restrict__ out, uint8_t* __restrict__ keep, int64_t vecs, int row_vecs,
                            float threshold, float scale, uint64_t seed, uint64_t offset) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int col = (int)(i % row_vecs);
  const int step = (int)(stride % row_vecs);
  for (; i < vecs; i += stride) {
    float u[N], v[N], b[N], r[N];
    bool kept[N];
    uniforms<T, N>((uint64_t)i * N, seed, offset, u);
    load<T, N>(x + i * N, v);
    load<T, N>(bias + col * N, b);
    load<T, N>(residual + i * N, r);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      kept[k] = u[k] < threshold;
      v[k] = (v[k] + b[k]) * (kept[k] ? scale : 0.f) + r[k];
    }
    store<T, N>(out + i * N, v);
    store_bytes<N>(keep + i * N, kept);
    col += step;
    if (col >= row_vecs) col -= row_vecs;
  }
}

template <typename T, int N, bool kWarp>
__global__ void __launch_bounds__(1024, 1)
    dropout_backward_kernel(const T* __restrict__ grad, const uint8_t* __restrict__ keep, T* __restrict__ dx,
                            float* __restrict__ partial, int64_t rows, int cols, float scale) {
  extern __shared__ float4 smem[];
  const RowGroup<kWarp> g;
  const int vecs = cols / N;
  float* acc = reinterpret_cast<float*>(smem) + (kWarp ? threadIdx.x / 32 : 0) * cols;
  zero_owned<kWarp>(acc, cols);
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const int64_t base = row * cols;
    for_each_vector<0>(g.rank, g.size, vecs, [&](int, int c) {
      float gv[N], kv[N];
      load<T, N>(grad + base + c * N, gv);
      load<uint8_t, N>(keep + base + c * N, kv);
#pragma unroll
      for (int k = 0; k < N; ++k) gv[k] = kv[k] != 0.f ? gv[k] * scale : 0.f;
      store<T, N>(dx + base + c * N, gv);
      add_to<N>(acc + c * N, gv);
    });
  }
  write_partials<kWarp>(reinterpret_cast<float*>(smem), 1, cols, partial);
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

cudaError_t sbp_bias_dropout_add(const void* x, const void* bias, const void* residual, void* out, uint8_t* keep,
                                 int64_t n, int64_t cols, float threshold, float scale, uint64_t seed,
                                 uint64_t offset, int dtype, int sm_count, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto launch = [&](auto kernel, int vec) {
      const int64_t vecs = n / vec;
      const int64_t grid = std::min<int64_t>(blocks_for(vecs, 256), resident_blocks((const void*)kernel, 256, 0, sm_count));
      kernel<<<(unsigned)grid, 256, 0, stream>>>((const T*)x, (const T*)bias, (const T*)residual, (T*)out, keep, vecs,
                                                (int)(cols / vec), threshold, scale, seed, offset);
    };
    const bool vector = aligned16(x) && aligned16(bias) && aligned16(residual) && aligned16(out) && aligned16(keep) &&
                        cols % kVec<T> == 0;
    vector ? launch(bias_dropout_add_kernel<T, kVec<T>>, kVec<T>) : launch(bias_dropout_add_kernel<T, 1>, 1);
  });
}

cudaError_t sbp_bias_dropout_add_backward(const void* grad, const uint8_t* keep, void* dx, void* dbias,
                                          float* partial, int64_t rows, int64_t cols, float scale, int dtype,
                                          int sm_count, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;  // the caller gives a zero dbias for no rows
  cudaError_t err = cudaSuccess;
  int parts = 0;
  const cudaError_t launched = dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const RowPlan plan = plan_rows(cols, kVec<T>, aligned16(grad) && aligned16(keep) && aligned16(dx), 4, 0);
    dispatch_shape<T, 0>(plan, [&](auto shape) {
      using S = decltype(shape);
      const auto kernel = dropout_backward_kernel<T, S::N, S::kWarp>;
      const ReduceLaunch rl =
          plan_reduce((const void*)kernel, plan, 1, rows, cols, sm_count, max_partial_rows(rows, sm_count));
      if ((err = rl.err) != cudaSuccess) return;
      kernel<<<rl.grid, plan.threads, rl.smem, stream>>>((const T*)grad, keep, (T*)dx, partial, rows, (int)cols, scale);
      parts = (int)rl.grid;
    });
  });
  if (err != cudaSuccess) return err;
  if (launched != cudaSuccess) return launched;
  return column_sums(partial, parts, cols, dbias, nullptr, dtype, stream);
}
