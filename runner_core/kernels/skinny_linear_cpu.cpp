// y = x W^T + b for a few rows of x (decode at small batch): each output column is a dot product of
// one contiguous weight row with every row of x, so the weights stream from memory once, in order,
// split across the threads by output rows; four weight rows at a time keep four independent
// accumulators in flight. Accumulates in float32 for every dtype. Registered as the torch op
// runner_kernels::skinny_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

template <typename T>
void skinny_kernel(T* out, const T* x, const T* w, const T* bias, int64_t rows, int64_t k, int64_t n) {
  // 64 output columns per task: a task reads >= 64 weight rows, enough to amortise its start
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) xf[i] = static_cast<float>(x[i]);
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t c0 = quad * 4, count = std::min<int64_t>(4, n - c0);
      const T* w0 = w + c0 * k;
      const T* w1 = count > 1 ? w0 + k : w0;
      const T* w2 = count > 2 ? w0 + 2 * k : w0;
      const T* w3 = count > 3 ? w0 + 3 * k : w0;
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xf.data() + r * k;
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t i = 0; i < k; ++i) {
          const float xv = xr[i];
          d0 += xv * static_cast<float>(w0[i]);
          d1 += xv * static_cast<float>(w1[i]);
          d2 += xv * static_cast<float>(w2[i]);
          d3 += xv * static_cast<float>(w3[i]);
        }
        const float dots[4] = {d0, d1, d2, d3};
        T* o = out + r * n + c0;
        for (int64_t c = 0; c < count; ++c)
          o[c] = static_cast<T>(bias ? dots[c] + static_cast<float>(bias[c0 + c]) : dots[c]);
      }
    }
  });
}

// x: [rows, k]; weight: [n, k]; bias: [n] or none -> [rows, n], all contiguous, one dtype.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [rows, k] and weight [n, k]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == weight.size(0) && b.scalar_type() == x.scalar_type(), "bias must be [n] of x's dtype");
  }
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "skinny_linear", [&] {
    skinny_kernel<scalar_t>(out.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                            b.defined() ? b.data_ptr<scalar_t>() : nullptr, x.size(0), x.size(1), weight.size(0));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner_kernels, m) { m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
