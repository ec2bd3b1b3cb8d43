// Torch-facing glue for cuda/*.cu: checks and prepares tensors, takes the current CUDA stream and calls the plain
// entry points. Exposed to Python as sbp_torch._kernels_cuda; sbp_torch/kernels/_cuda.py registers these as the
// CUDA kernels of the custom ops.
//
// Per call it does only what the kernel needs: contiguous() (a no-op for contiguous inputs), one allocation per
// output (plus a small float32 workspace for the column-reducing backwards), no host synchronisation, no
// float32 copies of inputs. Alignment is the kernels' business (misaligned views take their scalar paths).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs the cuBLAS and cuSPARSE headers
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <atomic>
#include <optional>  // optional tensor arguments: Python passes None
#include <tuple>

#include "../cuda/entry_points.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

int dtype_tag(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "sbp_torch kernels: CUDA dtype must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check(cudaError_t err) { TORCH_CHECK(err == cudaSuccess, "sbp_torch kernel launch: ", cudaGetErrorString(err)); }
cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// The current device's multiprocessors, asked once per device.
int sm_count() {
  static std::atomic<int> counts[64] = {};
  const int device = c10::cuda::current_device();
  if (device >= 64) return 132;  // only sizes persistent grids: any positive count is correct
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// x: [..., cols] on CUDA, one dtype with `others`; params: [cols].
void check_rows(const char* op, const Tensor& x, std::initializer_list<const Tensor*> others,
                std::initializer_list<const Tensor*> params = {}) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1, op, ": expected a CUDA tensor with at least one dim");
  TORCH_CHECK(x.size(-1) < (int64_t{1} << 31), op, ": rows of 2^31 or more elements are not supported");
  for (const Tensor* t : others)
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device() == x.device(), op,
                ": every tensor must have x's dtype and device");
  for (const Tensor* p : params)
    TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(-1), op, ": expected a parameter of shape [", x.size(-1), "]");
}

int64_t rows_of(const Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// The float32 workspace of a column-reducing backward (entry_points.h).
Tensor partials(const Tensor& x, int nacc) {
  return at::empty({nacc * sbp_reduce_partials(rows_of(x), sm_count()) * x.size(-1)}, x.options().dtype(at::kFloat));
}

Tensor bias_gelu(const Tensor& x_in, const Tensor& bias_in, bool tanh_approx) {
  check_rows("bias_gelu", x_in, {&bias_in}, {&bias_in});
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  Tensor y = at::empty_like(x);
  check(sbp_bias_gelu(x.data_ptr(), bias.data_ptr(), y.data_ptr(), x.numel(), x.size(-1), tanh_approx, dtype_tag(x),
                      sm_count(), stream()));
  return y;
}

std::tuple<Tensor, Tensor> bias_gelu_backward(const Tensor& grad_in, const Tensor& x_in, const Tensor& bias_in,
                                              bool tanh_approx) {
  check_rows("bias_gelu_backward", x_in, {&grad_in, &bias_in}, {&bias_in});
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor grad = grad_in.contiguous(), x = x_in.contiguous(), bias = bias_in.contiguous();
  Tensor dx = at::empty_like(x), dbias = rows_of(x) ? at::empty_like(bias) : at::zeros_like(bias);
  check(sbp_bias_gelu_backward(grad.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(), dbias.data_ptr(),
                               partials(x, 1).data_ptr<float>(), rows_of(x), x.size(-1), tanh_approx, dtype_tag(x),
                               sm_count(), stream()));
  return {dx, dbias};
}

// 1 - p as torch compares a tensor of x's dtype with a Python float: the float rounded to that dtype.
float keep_threshold(double p, at::ScalarType dtype) {
  const float v = (float)(1.0 - p);
  if (dtype == at::kHalf) return (float)c10::Half(v);
  if (dtype == at::kBFloat16) return (float)c10::BFloat16(v);
  return v;
}

std::tuple<Tensor, Tensor> bias_dropout_add(const Tensor& x_in, const Tensor& bias_in, const Tensor& residual_in,
                                            double p, int64_t seed, int64_t offset) {
  check_rows("bias_dropout_add", x_in, {&bias_in, &residual_in}, {&bias_in});
  TORCH_CHECK(residual_in.sizes() == x_in.sizes(), "bias_dropout_add: residual must have x's shape");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), bias = bias_in.contiguous(), residual = residual_in.contiguous();
  Tensor out = at::empty_like(x), keep = at::empty_like(x, x.options().dtype(at::kBool));
  const float scale = p >= 1.0 ? 0.f : (float)(1.0 / (1.0 - p));
  check(sbp_bias_dropout_add(x.data_ptr(), bias.data_ptr(), residual.data_ptr(), out.data_ptr(),
                             (uint8_t*)keep.data_ptr(), x.numel(), x.size(-1), keep_threshold(p, x.scalar_type()), scale,
                             (uint64_t)seed, (uint64_t)offset, dtype_tag(x), sm_count(), stream()));
  return {out, keep};
}

std::tuple<Tensor, Tensor> bias_dropout_add_backward(const Tensor& grad_in, const Tensor& keep_in, double scale) {
  check_rows("bias_dropout_add_backward", grad_in, {});
  TORCH_CHECK(keep_in.scalar_type() == at::kBool && keep_in.sizes() == grad_in.sizes(),
              "bias_dropout_add_backward: the mask must be bool of grad's shape");
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const Tensor grad = grad_in.contiguous(), keep = keep_in.contiguous();
  Tensor dx = at::empty_like(grad);
  Tensor dbias = rows_of(grad) ? at::empty({grad.size(-1)}, grad.options()) : at::zeros({grad.size(-1)}, grad.options());
  check(sbp_bias_dropout_add_backward(grad.data_ptr(), (const uint8_t*)keep.data_ptr(), dx.data_ptr(),
                                      dbias.data_ptr(), partials(grad, 1).data_ptr<float>(), rows_of(grad),
                                      grad.size(-1), (float)scale, dtype_tag(grad), sm_count(), stream()));
  return {dx, dbias};
}

// mask: None or a bool view of x's shape (a broadcast mask expanded: stride 0 where it repeats).
Tensor scale_mask_softmax(const Tensor& x_in, const OptTensor& mask_in, double scale, bool causal) {
  check_rows("scale_mask_softmax", x_in, {});
  TORCH_CHECK(x_in.dim() <= 4, "scale_mask_softmax: the CUDA kernel takes at most 4 dims");
  TORCH_CHECK(!causal || x_in.dim() >= 2, "scale_mask_softmax: causal needs (queries, keys) dims");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  int64_t size[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};  // x as [outer, heads, queries, cols]
  const int64_t pad = 4 - x.dim();
  for (int64_t d = 0; d < x.dim(); ++d) size[pad + d] = x.size(d);
  Tensor mask;
  if (mask_in.has_value()) {
    mask = *mask_in;
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.sizes() == x.sizes() && mask.device() == x.device(),
                "scale_mask_softmax: the mask must be a bool view of x's shape on x's device");
    if (x.size(-1) > 1 && mask.stride(-1) != 1) mask = mask.contiguous();  // the kernel reads mask rows as runs
    for (int64_t d = 0; d + 1 < x.dim(); ++d) strides[pad + d] = x.size(d) > 1 ? mask.stride(d) : 0;
  }
  Tensor y = at::empty_like(x);
  check(sbp_scale_mask_softmax(x.data_ptr(), mask.defined() ? (const uint8_t*)mask.data_ptr() : nullptr, y.data_ptr(),
                               rows_of(x), x.size(-1), strides, size[1], size[2], causal, (float)scale, dtype_tag(x),
                               stream()));
  return y;
}

Tensor scale_mask_softmax_backward(const Tensor& grad_in, const Tensor& y_in, double scale) {
  check_rows("scale_mask_softmax_backward", y_in, {&grad_in});
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Tensor grad = grad_in.contiguous(), y = y_in.contiguous();
  Tensor dx = at::empty_like(y);
  check(sbp_scale_mask_softmax_backward(grad.data_ptr(), y.data_ptr(), dx.data_ptr(), rows_of(y), y.size(-1),
                                        (float)scale, dtype_tag(y), stream()));
  return dx;
}

// (y, mean, rstd); mean is None for rms_norm (no bias). Statistics: float32, x's shape without the last dim.
std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& x_in, const Tensor& w_in, const OptTensor& b_in, double eps) {
  const bool centred = b_in.has_value();
  const Tensor b_or_w = centred ? *b_in : w_in;
  check_rows("norm_forward", x_in, {&w_in, &b_or_w}, {&w_in, &b_or_w});
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = centred ? b_in->contiguous() : Tensor();
  const auto stats = x.options().dtype(at::kFloat);
  const auto rows_shape = x.sizes().slice(0, x.dim() - 1);
  Tensor y = at::empty_like(x), mean = centred ? at::empty(rows_shape, stats) : Tensor(), rstd = at::empty(rows_shape, stats);
  check(sbp_norm_forward(x.data_ptr(), w.data_ptr(), centred ? b.data_ptr() : nullptr, y.data_ptr(),
                         centred ? mean.data_ptr<float>() : nullptr, rstd.data_ptr<float>(), rows_of(x), x.size(-1),
                         (float)eps, dtype_tag(x), stream()));
  return {y, mean, rstd};
}

// (dx, dw, db); db is None for rms_norm (mean None). dw, db: w's dtype, summed over rows in one pass.
std::tuple<Tensor, Tensor, Tensor> norm_backward(const Tensor& grad_in, const Tensor& x_in, const Tensor& w_in,
                                                 const OptTensor& mean_in, const Tensor& rstd_in) {
  check_rows("norm_backward", x_in, {&grad_in, &w_in}, {&w_in});
  const bool centred = mean_in.has_value();
  const Tensor mean_or_rstd = centred ? *mean_in : rstd_in;
  for (const Tensor* s : {&rstd_in, &mean_or_rstd})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->numel() == rows_of(x_in), "norm_backward: statistics must be float32, one per row");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor grad = grad_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  const Tensor mean = centred ? mean_in->contiguous() : Tensor(), rstd = rstd_in.contiguous();
  const bool any = rows_of(x) > 0;
  Tensor dx = at::empty_like(x), dw = any ? at::empty_like(w) : at::zeros_like(w);
  Tensor db = centred ? (any ? at::empty_like(w) : at::zeros_like(w)) : Tensor();
  check(sbp_norm_backward(grad.data_ptr(), x.data_ptr(), w.data_ptr(), centred ? mean.data_ptr<float>() : nullptr,
                          rstd.data_ptr<float>(), dx.data_ptr(), dw.data_ptr(), centred ? db.data_ptr() : nullptr,
                          partials(x, centred ? 2 : 1).data_ptr<float>(), rows_of(x), x.size(-1), dtype_tag(x),
                          sm_count(), stream()));
  return {dx, dw, db};
}

std::tuple<Tensor, Tensor, Tensor> cross_entropy_stats(const Tensor& logits_in, const Tensor& target_in,
                                                       int64_t first_class) {
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const Tensor logits = logits_in.contiguous(), target = target_in.contiguous();
  const auto opts = logits.options().dtype(at::kFloat);
  const int64_t rows = logits.size(0);
  Tensor m = at::empty({rows}, opts), s = at::empty({rows}, opts), picked = at::empty({rows}, opts);
  check(sbp_cross_entropy_stats(logits.data_ptr(), target.data_ptr<int64_t>(), m.data_ptr<float>(), s.data_ptr<float>(),
                                picked.data_ptr<float>(), rows, logits.size(1), first_class, dtype_tag(logits), stream()));
  return {m, s, picked};
}

Tensor cross_entropy_backward(const Tensor& logits_in, const Tensor& target_in, const Tensor& lse_in,
                              const Tensor& row_weight_in, int64_t first_class) {
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const Tensor logits = logits_in.contiguous(), target = target_in.contiguous();
  const Tensor lse = lse_in.to(at::kFloat).contiguous(), row_weight = row_weight_in.to(at::kFloat).contiguous();
  Tensor d = at::empty_like(logits);
  check(sbp_cross_entropy_backward(logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr<float>(),
                                   row_weight.data_ptr<float>(), d.data_ptr(), logits.size(0), logits.size(1),
                                   first_class, dtype_tag(logits), stream()));
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bias_gelu", &bias_gelu);
  m.def("bias_gelu_backward", &bias_gelu_backward);
  m.def("bias_dropout_add", &bias_dropout_add);
  m.def("bias_dropout_add_backward", &bias_dropout_add_backward);
  m.def("scale_mask_softmax", &scale_mask_softmax);
  m.def("scale_mask_softmax_backward", &scale_mask_softmax_backward);
  m.def("norm_forward", &norm_forward);
  m.def("norm_backward", &norm_backward);
  m.def("cross_entropy_stats", &cross_entropy_stats);
  m.def("cross_entropy_backward", &cross_entropy_backward);
}
