// bias_gelu: y = gelu(x + bias[col]) over rows of `cols` features; backward: dx = g * gelu'(x + bias), and
// dbias = sum over rows of dx.
//
// Forward: one grid-stride pass over 16-byte vectors (element-wise; the bias column is tracked by adding the
// stride modulo the row length instead of dividing per element). The tanh form is z * sigmoid(2u), one exp2
// and one reciprocal: tanhf is long enough that the bf16 kernel would be bound by arithmetic, not memory.
// Backward: a persistent grid of warps or blocks over rows, dx written per element and its column sums kept
// in shared memory, then column_sums (common.cuh).
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;

// gelu(z) and, with kGrad, its derivative instead.
template <bool kTanh, bool kGrad>
__device__ __forceinline__ float gelu(float z) {
  if (kTanh) {
    // 0.5 z (1 + tanh(u)) = z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3): one exp and one approximate
    // reciprocal (two MUFU operations). For very negative z the exp is huge or inf and the fast division
    // gives sigmoid 0 (not NaN)
    const float u = kSqrt2OverPi * (z + kCubic * z * z * z);
    const float s = __fdividef(1.f, 1.f + __expf(-2.f * u));
    if (!kGrad) return z * s;
    return s + z * s * (1.f - s) * 2.f * kSqrt2OverPi * (1.f + 3.f * kCubic * z * z);
  }
  const float cdf = 0.5f * (1.f + erff(z * 0.7071067811865476f));
  if (!kGrad) return z * cdf;
  return cdf + z * 0.3989422804014327f * __expf(-0.5f * z * z);
}

template <typename T, int N, bool kTanh>
__global__ void __launch_bounds__(256) bias_gelu_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                        T* __restrict__ y, int64_t vecs, int row_vecs) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int col = (int)(i % row_vecs);
  const int step = (int)(stride % row_vecs);
  for (; i < vecs; i += stride) {
    float v[N], b[N];
    load<T, N>(x + i * N, v);
    load<T, N>(bias + col * N, b);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = gelu<kTanh, false>(v[k] + b[k]);
    store<T, N>(y + i * N, v);
    col += step;
    if (col >= row_vecs) col -= row_vecs;
  }
}

template <typename T, int N, bool kWarp, bool kTanh>
__global__ void __launch_bounds__(1024, 1)
    bias_gelu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x, const T* __restrict__ bias,
                              T* __restrict__ dx, float* __restrict__ partial, int64_t rows, int cols) {
  extern __shared__ float4 smem[];
  const RowGroup<kWarp> g;
  const int vecs = cols / N;
  float* acc = reinterpret_cast<float*>(smem) + (kWarp ? threadIdx.x / 32 : 0) * cols;
  zero_owned<kWarp>(acc, cols);
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const int64_t base = row * cols;
    for_each_vector<0>(g.rank, g.size, vecs, [&](int, int c) {
      float gv[N], v[N], b[N];
      load<T, N>(grad + base + c * N, gv);
      load<T, N>(x + base + c * N, v);
      load<T, N>(bias + c * N, b);
#pragma unroll
      for (int k = 0; k < N; ++k) gv[k] *= gelu<kTanh, true>(v[k] + b[k]);
      store<T, N>(dx + base + c * N, gv);
      add_to<N>(acc + c * N, gv);
    });
  }
  write_partials<kWarp>(reinterpret_cast<float*>(smem), 1, cols, partial);
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

cudaError_t sbp_bias_gelu(const void* x, const void* bias, void* y, int64_t n, int64_t cols, bool tanh_approx,
                          int dtype, int sm_count, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vector = aligned16(x) && aligned16(bias) && aligned16(y) && cols % kVec<T> == 0;
    auto launch = [&](auto kernel, int vec) {
      const int64_t vecs = n / vec;
      const int64_t grid = std::min<int64_t>(blocks_for(vecs, 256), resident_blocks((const void*)kernel, 256, 0, sm_count));
      kernel<<<(unsigned)grid, 256, 0, stream>>>((const T*)x, (const T*)bias, (T*)y, vecs, (int)(cols / vec));
    };
    if (vector)
      tanh_approx ? launch(bias_gelu_kernel<T, kVec<T>, true>, kVec<T>) : launch(bias_gelu_kernel<T, kVec<T>, false>, kVec<T>);
    else
      tanh_approx ? launch(bias_gelu_kernel<T, 1, true>, 1) : launch(bias_gelu_kernel<T, 1, false>, 1);
  });
}

cudaError_t sbp_bias_gelu_backward(const void* grad, const void* x, const void* bias, void* dx, void* dbias,
                                   float* partial, int64_t rows, int64_t cols, bool tanh_approx, int dtype,
                                   int sm_count, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;  // the caller gives a zero dbias for no rows
  cudaError_t err = cudaSuccess;
  int parts = 0;
  const cudaError_t launched = dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool aligned = aligned16(grad) && aligned16(x) && aligned16(bias) && aligned16(dx);
    const RowPlan plan = plan_rows(cols, kVec<T>, aligned, 4, 0);
    dispatch_shape<T, 0>(plan, [&](auto shape) {
      using S = decltype(shape);
      auto run = [&](auto kernel) {
        const ReduceLaunch rl = plan_reduce((const void*)kernel, plan, 1, rows, cols, sm_count,
                                            max_partial_rows(rows, sm_count));
        if ((err = rl.err) != cudaSuccess) return;
        kernel<<<rl.grid, plan.threads, rl.smem, stream>>>((const T*)grad, (const T*)x, (const T*)bias, (T*)dx,
                                                          partial, rows, (int)cols);
        parts = (int)rl.grid;
      };
      tanh_approx ? run(bias_gelu_backward_kernel<T, S::N, S::kWarp, true>)
                  : run(bias_gelu_backward_kernel<T, S::N, S::kWarp, false>);
    });
  });
  if (err != cudaSuccess) return err;
  if (launched != cudaSuccess) return launched;
  return column_sums(partial, parts, cols, dbias, nullptr, dtype, stream);
}
