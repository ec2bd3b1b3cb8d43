// The plain C entry points of cuda/*.cu (device pointers, sizes, a dtype tag 0/1/2 = fp32/fp16/bf16, a
// stream); each returns the launch's cudaError_t. Included by csrc/ glue; no torch here.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

cudaError_t sbp_bias_gelu(const void* x, const void* bias, const void* grad, void* out, int64_t n, int64_t cols,
                          bool tanh_approx, int dtype, cudaStream_t stream);
cudaError_t sbp_bias_dropout_add(const void* x, const void* bias, const void* residual, void* out, uint8_t* mask,
                                 const int64_t* indices, int64_t first_index, int64_t n, int64_t cols, float p,
                                 uint64_t seed, uint64_t offset, int dtype, cudaStream_t stream);
cudaError_t sbp_dropout_backward(const void* grad, const uint8_t* mask, void* grad_x, int64_t n, float scale,
                                 int dtype, cudaStream_t stream);
cudaError_t sbp_scale_mask_softmax(const void* x, const uint8_t* mask, void* y, int64_t rows, int64_t cols,
                                   int64_t mask_rows, int64_t queries, float scale, int dtype, cudaStream_t stream);
cudaError_t sbp_scale_mask_softmax_backward(const void* grad, const void* y, void* dx, int64_t rows, int64_t cols,
                                            float scale, int dtype, cudaStream_t stream);
cudaError_t sbp_norm_forward(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                             int64_t rows, int64_t cols, float eps, int dtype, cudaStream_t stream);
cudaError_t sbp_norm_backward(const void* grad, const void* x, const void* w, const float* mean, const float* rstd,
                              void* dx, float* partial_w, float* partial_b, int64_t rows, int64_t cols, int dtype,
                              cudaStream_t stream);
cudaError_t sbp_cross_entropy_stats(const void* logits, const int64_t* target, float* row_max, float* row_sum_exp,
                                    float* row_picked, int64_t rows, int64_t classes, int64_t first_class, int dtype,
                                    cudaStream_t stream);
cudaError_t sbp_cross_entropy_backward(const void* logits, const int64_t* target, const float* lse,
                                       const float* row_weight, void* dlogits, int64_t rows, int64_t classes,
                                       int64_t first_class, int dtype, cudaStream_t stream);
