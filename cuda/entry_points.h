// The plain C entry points of cuda/*.cu (device pointers, sizes, a dtype tag 0/1/2 = fp32/fp16/bf16, a
// stream); each returns the launch's cudaError_t. Included by csrc/ glue; no torch here.
//
// Tensors are contiguous row-major [rows, cols] (n = rows * cols elements); per-feature parameters are [cols];
// every tensor of one call has the dtype of the tag, statistics are float32. Any alignment is accepted: 16-byte
// aligned pointers with cols a multiple of 16 / sizeof(dtype) take the vector paths. `sm_count`: the device's
// multiprocessors (persistent and grid-stride kernels size their grids by it).
//
// Column-reducing backwards (the bias and weight gradients) need a float32 workspace `partial` of
// nacc * sbp_reduce_partials(rows, sm_count) * cols floats (nacc: 2 for layer_norm, else 1), and write
// nothing when rows == 0 (the caller gives zero gradients then).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

int64_t sbp_reduce_partials(int64_t rows, int sm_count);

cudaError_t sbp_bias_gelu(const void* x, const void* bias, void* y, int64_t n, int64_t cols, bool tanh_approx,
                          int dtype, int sm_count, cudaStream_t stream);
cudaError_t sbp_bias_gelu_backward(const void* grad, const void* x, const void* bias, void* dx, void* dbias,
                                   float* partial, int64_t rows, int64_t cols, bool tanh_approx, int dtype,
                                   int sm_count, cudaStream_t stream);

// keep: uint8 0/1 per element (a bool tensor's storage); threshold: 1 - p rounded to the dtype.
cudaError_t sbp_bias_dropout_add(const void* x, const void* bias, const void* residual, void* out, uint8_t* keep,
                                 int64_t n, int64_t cols, float threshold, float scale, uint64_t seed,
                                 uint64_t offset, int dtype, int sm_count, cudaStream_t stream);
cudaError_t sbp_bias_dropout_add_backward(const void* grad, const uint8_t* keep, void* dx, void* dbias,
                                          float* partial, int64_t rows, int64_t cols, float scale, int dtype,
                                          int sm_count, cudaStream_t stream);

// x seen as [outer, heads, queries, cols] (rows = outer * heads * queries); mask: nullptr or uint8 with element
// (o, h, q, c) at o * mask_strides[0] + h * mask_strides[1] + q * mask_strides[2] + c; causal excludes c > q.
cudaError_t sbp_scale_mask_softmax(const void* x, const uint8_t* mask, void* y, int64_t rows, int64_t cols,
                                   const int64_t* mask_strides, int64_t heads, int64_t queries, bool causal,
                                   float scale, int dtype, cudaStream_t stream);
cudaError_t sbp_scale_mask_softmax_backward(const void* grad, const void* y, void* dx, int64_t rows, int64_t cols,
                                            float scale, int dtype, cudaStream_t stream);

// b == nullptr and mean == nullptr: rms_norm; otherwise layer_norm.
cudaError_t sbp_norm_forward(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                             int64_t rows, int64_t cols, float eps, int dtype, cudaStream_t stream);
cudaError_t sbp_norm_backward(const void* grad, const void* x, const void* w, const float* mean, const float* rstd,
                              void* dx, void* dw, void* db, float* partial, int64_t rows, int64_t cols, int dtype,
                              int sm_count, cudaStream_t stream);

cudaError_t sbp_cross_entropy_stats(const void* logits, const int64_t* target, float* row_max, float* row_sum_exp,
                                    float* row_picked, int64_t rows, int64_t classes, int64_t first_class, int dtype,
                                    cudaStream_t stream);
cudaError_t sbp_cross_entropy_backward(const void* logits, const int64_t* target, const float* lse,
                                       const float* row_weight, void* dlogits, int64_t rows, int64_t classes,
                                       int64_t first_class, int dtype, cudaStream_t stream);
