// Torch-facing glue for cuda/*.cu: checks and prepares tensors (contiguous copies of strided inputs, float32
// statistics), takes the current CUDA stream and calls the plain entry points. Exposed to Python as
// sbp_torch._kernels_cuda; sbp_torch/kernels/_cuda.py registers these as the CUDA kernels of the custom ops.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <optional>  // optional tensor arguments: Python passes None

#include "../cuda/entry_points.h"

namespace {

int dtype_tag(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "sbp_torch kernels: CUDA dtype must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check(cudaError_t err) { TORCH_CHECK(err == cudaSuccess, "sbp_torch kernel launch: ", cudaGetErrorString(err)); }
cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }
int64_t rows_of(const at::Tensor& x) { return x.dim() ? x.numel() / x.size(-1) : 1; }

at::Tensor bias_gelu(at::Tensor x, at::Tensor bias, std::optional<at::Tensor> grad_or_none, bool tanh_approx) {
  at::Tensor grad = grad_or_none.value_or(at::Tensor());
  x = x.contiguous(), bias = bias.contiguous();
  const bool backward = grad.defined();
  if (backward) grad = grad.contiguous();
  auto out = at::empty_like(x);
  check(sbp_bias_gelu(x.data_ptr(), bias.data_ptr(), backward ? grad.data_ptr() : nullptr, out.data_ptr(), x.numel(),
                      x.size(-1), tanh_approx, dtype_tag(x), stream()));
  return out;
}

std::vector<at::Tensor> bias_dropout_add(at::Tensor x, at::Tensor bias, at::Tensor residual, double p,
                                         std::optional<at::Tensor> indices_or_none, int64_t first_index, int64_t seed,
                                         int64_t offset) {
  at::Tensor indices = indices_or_none.value_or(at::Tensor());
  x = x.contiguous(), bias = bias.contiguous(), residual = residual.contiguous();
  auto out = at::empty_like(x);
  auto mask = at::empty_like(x, x.options().dtype(at::kBool));
  const int64_t* idx = indices.defined() ? indices.contiguous().data_ptr<int64_t>() : nullptr;
  check(sbp_bias_dropout_add(x.data_ptr(), bias.data_ptr(), residual.data_ptr(), out.data_ptr(),
                             (uint8_t*)mask.data_ptr(), idx, first_index, x.numel(), x.size(-1), (float)p,
                             (uint64_t)seed, (uint64_t)offset, dtype_tag(x), stream()));
  return {out, mask};
}

at::Tensor scale_mask_softmax(at::Tensor x, std::optional<at::Tensor> mask_or_none, double scale, int64_t queries) {
  at::Tensor mask = mask_or_none.value_or(at::Tensor());
  x = x.contiguous();
  const uint8_t* m = nullptr;
  int64_t mask_rows = 1;
  if (mask.defined()) {  // the caller expands the mask to x's trailing dims it needs: [mask_rows, cols]
    mask = mask.contiguous().to(at::kByte);
    m = mask.data_ptr<uint8_t>();
    mask_rows = rows_of(mask);
  }
  auto y = at::empty_like(x);
  check(sbp_scale_mask_softmax(x.data_ptr(), m, y.data_ptr(), rows_of(x), x.size(-1), mask_rows, queries,
                               (float)scale, dtype_tag(x), stream()));
  return y;
}

at::Tensor scale_mask_softmax_backward(at::Tensor grad, at::Tensor y, double scale) {
  grad = grad.contiguous(), y = y.contiguous();
  auto dx = at::empty_like(y);
  check(sbp_scale_mask_softmax_backward(grad.data_ptr(), y.data_ptr(), dx.data_ptr(), rows_of(y), y.size(-1),
                                        (float)scale, dtype_tag(y), stream()));
  return dx;
}

std::vector<at::Tensor> norm_forward(at::Tensor x, at::Tensor w, std::optional<at::Tensor> b_or_none, double eps) {
  at::Tensor b = b_or_none.value_or(at::Tensor());
  x = x.contiguous(), w = w.contiguous();
  const bool centred = b.defined();
  if (centred) b = b.contiguous();
  auto y = at::empty_like(x);
  auto stats = x.options().dtype(at::kFloat);
  auto mean = centred ? at::empty({rows_of(x)}, stats) : at::Tensor();
  auto rstd = at::empty({rows_of(x)}, stats);
  check(sbp_norm_forward(x.data_ptr(), w.data_ptr(), centred ? b.data_ptr() : nullptr, y.data_ptr(),
                         centred ? mean.data_ptr<float>() : nullptr, rstd.data_ptr<float>(), rows_of(x), x.size(-1),
                         (float)eps, dtype_tag(x), stream()));
  return {y, mean, rstd};
}

// (dx, dw, db): the per-row terms of dw, db are summed over rows here (float32, then the parameter dtype).
std::vector<at::Tensor> norm_backward(at::Tensor grad, at::Tensor x, at::Tensor w, std::optional<at::Tensor> mean_or_none,
                                      at::Tensor rstd) {
  at::Tensor mean = mean_or_none.value_or(at::Tensor());
  grad = grad.contiguous(), x = x.contiguous(), w = w.contiguous();
  const bool centred = mean.defined();
  auto dx = at::empty_like(x);
  auto pw = at::empty({rows_of(x), x.size(-1)}, x.options().dtype(at::kFloat));
  auto pb = centred ? at::empty_like(pw) : at::Tensor();
  check(sbp_norm_backward(grad.data_ptr(), x.data_ptr(), w.data_ptr(), centred ? mean.data_ptr<float>() : nullptr,
                          rstd.data_ptr<float>(), dx.data_ptr(), pw.data_ptr<float>(),
                          centred ? pb.data_ptr<float>() : nullptr, rows_of(x), x.size(-1), dtype_tag(x), stream()));
  auto dw = pw.sum(0).to(w.scalar_type());
  return {dx, dw, centred ? pb.sum(0).to(w.scalar_type()) : at::Tensor()};
}

std::vector<at::Tensor> cross_entropy_stats(at::Tensor logits, at::Tensor target, int64_t first_class) {
  logits = logits.contiguous(), target = target.contiguous();
  auto opts = logits.options().dtype(at::kFloat);
  const int64_t rows = logits.size(0);
  auto m = at::empty({rows}, opts), s = at::empty({rows}, opts), picked = at::empty({rows}, opts);
  check(sbp_cross_entropy_stats(logits.data_ptr(), target.data_ptr<int64_t>(), m.data_ptr<float>(), s.data_ptr<float>(),
                                picked.data_ptr<float>(), rows, logits.size(1), first_class, dtype_tag(logits), stream()));
  return {m, s, picked};
}

at::Tensor cross_entropy_backward(at::Tensor logits, at::Tensor target, at::Tensor lse, at::Tensor row_weight,
                                  int64_t first_class) {
  logits = logits.contiguous(), target = target.contiguous();
  lse = lse.to(at::kFloat).contiguous(), row_weight = row_weight.to(at::kFloat).contiguous();
  auto d = at::empty_like(logits);
  check(sbp_cross_entropy_backward(logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr<float>(),
                                   row_weight.data_ptr<float>(), d.data_ptr(), logits.size(0), logits.size(1),
                                   first_class, dtype_tag(logits), stream()));
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bias_gelu", &bias_gelu);
  m.def("bias_dropout_add", &bias_dropout_add);
  m.def("scale_mask_softmax", &scale_mask_softmax);
  m.def("scale_mask_softmax_backward", &scale_mask_softmax_backward);
  m.def("norm_forward", &norm_forward);
  m.def("norm_backward", &norm_backward);
  m.def("cross_entropy_stats", &cross_entropy_stats);
  m.def("cross_entropy_backward", &cross_entropy_backward);
}
