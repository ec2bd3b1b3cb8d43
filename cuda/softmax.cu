// scale_mask_softmax over rows of length `cols`: y = softmax(x * scale) with excluded positions (mask != 0, the
// mask broadcast to x's shape by strides; or, causal, key j > query i) at -inf.
//
// A warp per row (short rows) or a block per row; the row is read once into registers, as log2-scaled logits
// (scale * log2(e) folded into one multiply, exp2 instead of exp), reduced to its max, exponentiated in place,
// reduced to its sum, and written with 16-byte stores. Rows too long for registers stream (three reads).
// Backward: dx = scale * y * (g - sum(g * y)), g and y of a row in registers.
#include "common.cuh"
#include "entry_points.h"

namespace sbp_kernels {

// x seen as [outer, heads, queries, cols]; the mask's element (o, h, q, c) is at o * stride_outer + h *
// stride_heads + q * stride_queries + c (stride 0 where it broadcasts).
struct MaskLayout {
  const uint8_t* mask;
  int64_t stride_outer, stride_heads, stride_queries, heads, queries;
  bool causal;
};

template <typename T, int N, int NV, bool kWarp>
__global__ void __launch_bounds__(1024, 1) softmax_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                                       int cols, MaskLayout m, float scale_log2e) {
  __shared__ float scratch[32];
  const RowGroup<kWarp> g;
  const int vecs = cols / N;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const T* xr = x + row * cols;
    int64_t query = 0;
    const uint8_t* mr = nullptr;
    if (m.mask || m.causal) {
      const int64_t outer = div_small(row, m.queries);
      query = row - outer * m.queries;
      if (m.mask) {
        const int64_t o = div_small(outer, m.heads);
        mr = m.mask + o * m.stride_outer + (outer - o * m.heads) * m.stride_heads + query * m.stride_queries;
      }
    }
    auto logits = [&](int c, float (&v)[N]) {  // the log2-scaled logits of vector c, -inf where excluded
      float excluded[N] = {};
      load<T, N>(xr + c * N, v);
      if (mr) load<uint8_t, N>(mr + c * N, excluded);
#pragma unroll
      for (int k = 0; k < N; ++k)
        v[k] = excluded[k] != 0.f || (m.causal && c * N + k > query) ? -INFINITY : v[k] * scale_log2e;
    };
    float v[NV > 0 ? NV : 1][N];
    float mx = -INFINITY;
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      logits(c, v[j]);
#pragma unroll
      for (int k = 0; k < N; ++k) mx = fmaxf(mx, v[j][k]);
    });
    mx = g.max(mx, scratch);
    // a row with every position excluded has mx = -inf and gives NaN (exp2(-inf - -inf)), as the unfused
    // masked_fill(-inf) + softmax does
    float s = 0.f;
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      if (NV == 0) logits(c, v[j]);
#pragma unroll
      for (int k = 0; k < N; ++k) s += v[j][k] = exp2f(v[j][k] - mx);
    });
    const float r = 1.f / g.sum(s, scratch);
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      if (NV == 0) {
        logits(c, v[j]);
#pragma unroll
        for (int k = 0; k < N; ++k) v[j][k] = exp2f(v[j][k] - mx);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) v[j][k] *= r;
      store<T, N>(y + row * cols + c * N, v[j]);
    });
  }
}

template <typename T, int N, int NV, bool kWarp>
__global__ void __launch_bounds__(1024, 1) softmax_backward_kernel(const T* __restrict__ grad, const T* __restrict__ y,
                                                                T* __restrict__ dx, int64_t rows, int cols, float scale) {
  __shared__ float scratch[32];
  const RowGroup<kWarp> g;
  const int vecs = cols / N;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const T *gr = grad + row * cols, *yr = y + row * cols;
    float gv[NV > 0 ? NV : 1][N], yv[NV > 0 ? NV : 1][N];
    float dot = 0.f;
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      load<T, N>(gr + c * N, gv[j]);
      load<T, N>(yr + c * N, yv[j]);
#pragma unroll
      for (int k = 0; k < N; ++k) dot += gv[j][k] * yv[j][k];
    });
    dot = g.sum(dot, scratch);
    for_each_vector<NV>(g.rank, g.size, vecs, [&](int j, int c) {
      if (NV == 0) {
        load<T, N>(gr + c * N, gv[j]);
        load<T, N>(yr + c * N, yv[j]);
      }
      float out[N];
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = scale * yv[j][k] * (gv[j][k] - dot);
      store<T, N>(dx + row * cols + c * N, out);
    });
  }
}

}  // namespace sbp_kernels

using namespace sbp_kernels;

cudaError_t sbp_scale_mask_softmax(const void* x, const uint8_t* mask, void* y, int64_t rows, int64_t cols,
                                   const int64_t* mask_strides, int64_t heads, int64_t queries, bool causal,
                                   float scale, int dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const MaskLayout layout{mask, mask ? mask_strides[0] : 0, mask ? mask_strides[1] : 0, mask ? mask_strides[2] : 0,
                          heads, queries, causal};
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = kVec<T>;  // a vector of mask bytes is V bytes: its rows must start on V bytes
    const bool mask_aligned = !mask || (reinterpret_cast<uintptr_t>(mask) % V == 0 && layout.stride_outer % V == 0 &&
                                        layout.stride_heads % V == 0 && layout.stride_queries % V == 0);
    const RowPlan plan = plan_rows(cols, V, aligned16(x) && aligned16(y) && mask_aligned, 4, 4);
    dispatch_shape<T, 4>(plan, [&](auto shape) {
      using S = decltype(shape);
      softmax_kernel<T, S::N, S::NV, S::kWarp><<<blocks_for(rows, plan.rows_per_block()), plan.threads, 0, stream>>>(
          (const T*)x, (T*)y, rows, (int)cols, layout, scale * 1.4426950408889634f);
    });
  });
}

cudaError_t sbp_scale_mask_softmax_backward(const void* grad, const void* y, void* dx, int64_t rows, int64_t cols,
                                            float scale, int dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const RowPlan plan = plan_rows(cols, kVec<T>, aligned16(grad) && aligned16(y) && aligned16(dx), 2, 2);
    dispatch_shape<T, 2>(plan, [&](auto shape) {
      using S = decltype(shape);
      softmax_backward_kernel<T, S::N, S::NV, S::kWarp>
          <<<blocks_for(rows, plan.rows_per_block()), plan.threads, 0, stream>>>((const T*)grad, (const T*)y, (T*)dx,
                                                                                rows, (int)cols, scale);
    });
  });
}
