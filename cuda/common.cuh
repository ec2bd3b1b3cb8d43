// Shared by the fused kernels: dtype tags, float conversion, 16-byte vector loads and stores, the mapping of
// rows to warps or blocks, reductions, launch helpers. Entry points are plain C++ functions taking device
// pointers, sizes, a dtype tag and a cudaStream_t; they return cudaGetLastError() so the caller (csrc/,
// torch-facing) turns a launch failure into an exception. No torch headers here: CI compiles every .cu with
// `nvcc -c` on a machine without torch's CUDA build.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

namespace sbp_kernels {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(uint8_t v) { return v; }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---------------------------------------------------------------------------------------------------------
// Vectors: N elements moved by one load or store of N * sizeof(T) bytes. The fast paths use N = kVec<T>
// (16 bytes: one LDG.128 / STG.128 per thread); N = 1 is the fallback for misaligned pointers and rows whose
// length is not a multiple of kVec<T>. The address must be aligned to N * sizeof(T).

template <typename T> constexpr int kVec = 16 / sizeof(T);

template <int Bytes> struct RawOf;
template <> struct RawOf<16> { using type = uint4; };
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<4> { using type = uint32_t; };
template <> struct RawOf<2> { using type = uint16_t; };
template <> struct RawOf<1> { using type = uint8_t; };
template <typename T, int N> using Raw = typename RawOf<sizeof(T) * N>::type;

template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  const Raw<T, N> raw = *reinterpret_cast<const Raw<T, N>*>(p);
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float(v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Raw<T, N> raw;
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = from_float<T>(in[k]);
  *reinterpret_cast<Raw<T, N>*>(p) = raw;
}

// a / b for b > 0, in 32 bits where both fit (a 64-bit division is several times longer)
__device__ __forceinline__ int64_t div_small(int64_t a, int64_t b) {
  return (a | b) < 0x80000000LL ? (int64_t)((uint32_t)a / (uint32_t)b) : a / b;
}

// ---------------------------------------------------------------------------------------------------------
// Reductions

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over the block; every thread gets the result. `scratch` holds 32 floats.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float identity = kMax ? -INFINITY : 0.0f;
  if (warp == 0) {
    v = lane < (int)(blockDim.x / 32) ? scratch[lane] : identity;
    v = kMax ? warp_max(v) : warp_sum(v);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();  // every warp reads the total: warp 0 alone had it (found on an H100, rows over 32 long)
  return scratch[0];
}

// ---------------------------------------------------------------------------------------------------------
// Rows: the threads that share one row of a row-major [rows, cols] tensor are a warp (short rows: blockDim / 32
// rows per block, no __syncthreads) or the whole block (long rows). A group walks rows first, first + stride, ...
// Thread `rank` of the group holds the row's vectors rank, rank + size, ...: with NV > 0 the kernels keep them in
// registers (float[NV][N], read from global memory once); NV = 0 streams over them, re-reading the row per pass
// (rows too long for registers).

template <bool kWarp>
struct RowGroup {
  int rank, size;
  int64_t first, stride;
  __device__ RowGroup() {
    if (kWarp) {
      const int per_block = blockDim.x / 32;
      rank = threadIdx.x % 32, size = 32;
      first = (int64_t)blockIdx.x * per_block + threadIdx.x / 32, stride = (int64_t)gridDim.x * per_block;
    } else {
      rank = threadIdx.x, size = blockDim.x, first = blockIdx.x, stride = gridDim.x;
    }
  }
  __device__ float sum(float v, float* scratch) const { return kWarp ? warp_sum(v) : block_reduce<false>(v, scratch); }
  __device__ float max(float v, float* scratch) const { return kWarp ? warp_max(v) : block_reduce<true>(v, scratch); }
};

// Calls f(slot, vector) for each of this thread's vectors of a row of `vecs` vectors; slot < max(NV, 1) indexes
// the thread's registers (always 0 when streaming).
template <int NV, typename F>
__device__ __forceinline__ void for_each_vector(int rank, int size, int vecs, F&& f) {
  if constexpr (NV > 0) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
      if (rank + j * size < vecs) f(j, rank + j * size);
  } else {
    for (int c = rank; c < vecs; c += size) f(0, c);
  }
}

// The compile-time shape of a row kernel: vector width N, vectors per thread NV (0: streaming), warp or block rows.
template <int N_, int NV_, bool kWarp_>
struct Shape {
  static constexpr int N = N_, NV = NV_;
  static constexpr bool kWarp = kWarp_;
};

// Which shape a row kernel runs with, and its block size. `aligned`: every pointer is 16-byte aligned (and
// every other alignment the kernel needs holds); otherwise, or when cols is not a multiple of the vector width,
// vectors of one element, streamed by one block per row.
struct RowPlan {
  bool vector, warp;
  int nv, threads;
  int rows_per_block() const { return warp ? threads / 32 : 1; }
};

inline int pow2_at_least(int64_t v) {  // capped at 2^30: only ever compared with or clamped to far less
  int p = 1;
  while (p < v && p < (1 << 30)) p <<= 1;
  return p;
}

inline int clamp_threads(int64_t v, int lo) { return v < lo ? lo : v > 1024 ? 1024 : (int)v; }

// `per_thread`: the vectors a thread should hold (several 16-byte loads in flight, few registers); `max_nv`:
// the most a kernel keeps in registers (0: it streams). Longer rows stream.
inline RowPlan plan_rows(int64_t cols, int vec, bool aligned, int per_thread, int max_nv) {
  if (!aligned || cols % vec != 0)  // one element at a time, a block per row, about 4 elements per thread
    return {false, false, 0, clamp_threads(pow2_at_least((cols + 3) / 4), 32)};
  const int64_t vecs = cols / vec;
  if (vecs <= 32 * per_thread) {  // a warp per row: 4 rows per block of 128 threads
    const int nv = pow2_at_least((vecs + 31) / 32);
    return {true, true, nv <= max_nv ? nv : 0, 128};
  }
  const int threads = clamp_threads(pow2_at_least((vecs + per_thread - 1) / per_thread), 64);
  const int nv = pow2_at_least((vecs + threads - 1) / threads);
  return {true, false, nv <= max_nv ? nv : 0, threads};
}

// Calls launch(Shape<...>{}) for the plan's shape, instantiating the shapes with NV <= kMaxNV (the plan's
// max_nv): vector width 1 only streams by blocks.
template <typename T, int kMaxNV, typename Launch>
void dispatch_shape(const RowPlan& plan, Launch&& launch) {
  constexpr int V = kVec<T>;
  if (!plan.vector) return launch(Shape<1, 0, false>{});
  auto with = [&](auto warp) {
    constexpr bool W = decltype(warp)::value;
    if constexpr (kMaxNV >= 4)
      if (plan.nv == 4) return launch(Shape<V, 4, W>{});
    if constexpr (kMaxNV >= 2)
      if (plan.nv == 2) return launch(Shape<V, 2, W>{});
    if constexpr (kMaxNV >= 1)
      if (plan.nv == 1) return launch(Shape<V, 1, W>{});
    return launch(Shape<V, 0, W>{});
  };
  plan.warp ? with(std::true_type{}) : with(std::false_type{});
}

// ---------------------------------------------------------------------------------------------------------
// Launch helpers

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f((T*)nullptr) for the dtype tag; unknown tags return cudaErrorInvalidValue.
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

inline unsigned blocks_for(int64_t n, int per_block) {
  const int64_t g = (n + per_block - 1) / per_block;
  return (unsigned)(g < 1 ? 1 : g > 0x7fffffff ? 0x7fffffff : g);
}

// Blocks of `kernel` that fit on the device at once (grid-stride kernels launch no more), cached per kernel,
// block size and shared memory.
int resident_blocks(const void* kernel, int threads, int smem, int sm_count);

// Lets `kernel` use up to the device's opt-in shared memory per block (once per kernel and device).
cudaError_t allow_large_smem(const void* kernel);

// Second stage of a column reduction: out_a[c] = sum_p partial[p][c] (and out_b from the next `parts` rows of
// `partial` when out_b is set), in the outputs' dtype. Defined in column_sums.cu.
cudaError_t column_sums(const float* partial, int parts, int64_t cols, void* out_a, void* out_b, int dtype,
                        cudaStream_t stream);

// The end of a column-reducing backward: `acc` holds, per warp (warp rows) or for the block, `nacc` rows of
// `cols` float sums over the rows this block walked; this block's total of each goes to row blockIdx.x of
// the matching [gridDim.x, cols] plane of `partial`.
template <bool kWarp>
__device__ void write_partials(const float* acc, int nacc, int cols, float* partial) {
  __syncthreads();  // the warps' sums are complete
  const int sets = kWarp ? blockDim.x / 32 : 1, total = nacc * cols;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < sets; ++w) s += acc[w * total + i];
    partial[((int64_t)(i / cols) * gridDim.x + blockIdx.x) * cols + i % cols] = s;
  }
}

// Zeroes the `count` floats of shared memory from `acc` that belong to this thread's warp (warp rows) or block;
// every thread of the block must call it (a barrier follows).
template <bool kWarp>
__device__ __forceinline__ void zero_owned(float* acc, int count) {
  const int rank = kWarp ? threadIdx.x % 32 : threadIdx.x, size = kWarp ? 32 : blockDim.x;
  for (int i = rank; i < count; i += size) acc[i] = 0.f;
  __syncthreads();
}

// Adds v to the N floats at a (16-byte aligned when N is a multiple of 4: shared-memory vector accesses).
template <int N>
__device__ __forceinline__ void add_to(float* a, const float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      float4 t = *reinterpret_cast<float4*>(a + k);
      t.x += v[k], t.y += v[k + 1], t.z += v[k + 2], t.w += v[k + 3];
      *reinterpret_cast<float4*>(a + k) = t;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) a[k] += v[k];
  }
}

// Rows of per-block partial sums a column-reducing backward writes at most: enough blocks to fill the device,
// but at least 32 rows per block so that the partials stay a few percent of the traffic.
inline int max_partial_rows(int64_t rows, int sm_count) {
  const int64_t by_rows = (rows + 31) / 32, by_device = 8LL * sm_count;
  const int64_t p = by_rows < by_device ? by_rows : by_device;
  return (int)(p < 1 ? 1 : p);
}

// Grid and shared memory of a column-reducing row kernel: `nacc` float sums per column, per warp (warp rows)
// or per block; no more blocks than fit at once, than `partial_rows`, or than there are row groups.
struct ReduceLaunch {
  unsigned grid;
  int smem;
  cudaError_t err;
};
inline ReduceLaunch plan_reduce(const void* kernel, const RowPlan& plan, int nacc, int64_t rows, int64_t cols,
                                int sm_count, int partial_rows) {
  const int smem = (int)(nacc * cols * sizeof(float)) * (plan.warp ? plan.threads / 32 : 1);
  const cudaError_t err = smem > 48 * 1024 ? allow_large_smem(kernel) : cudaSuccess;
  int64_t grid = blocks_for(rows, plan.rows_per_block());
  const int64_t resident = resident_blocks(kernel, plan.threads, smem, sm_count);
  grid = grid < resident ? grid : resident;
  grid = grid < partial_rows ? grid : partial_rows;
  return {(unsigned)grid, smem, err};
}

}  // namespace sbp_kernels
