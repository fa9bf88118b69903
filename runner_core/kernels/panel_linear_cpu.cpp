// y = x W^T + b in float32 over a prepacked W: the weight [n, k] is stored as panels of 16 output
// columns, [ceil(n / 16), k, 16] (zero padded), so for each k one panel gives 16 contiguous floats
// (two AVX registers). A register tile of 6 rows x 16 columns (12 accumulators) does 12 FMAs per 2
// loads and 6 broadcasts; rows past the last multiple of 6 take smaller tiles, one row a k-unrolled
// tile with 8 accumulators. The threads split the panels, so every panel is read from memory once
// per call and reused from cache by all rows. Registered as runner_kernels::pack_panels and
// runner_kernels::panel_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>

#include "panel_tile.h"

namespace {

using runner_kernels::NR;
using runner_kernels::panel_rows;

// weight [n, k] -> [ceil(n / 16), k, 16]
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels: a float32 [n, k] weight");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR;
  // its own pages (mmap, zero-filled): freed with the model they go straight back to the system. From
  // malloc they would raise glibc's mmap threshold and the next model's tensors would stay in the heap
  // after an unload (tests/test_unload_memory.py)
  const size_t bytes = std::max<size_t>(1, panels * k * NR * sizeof(float));
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mem != MAP_FAILED, "pack_panels: cannot map ", bytes, " bytes for the panels");
  auto out = at::from_blob(mem, {panels, k, NR}, [bytes](void* p) { munmap(p, bytes); }, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < NR && p * NR + c < n; ++c) {
        const float* row = src + (p * NR + c) * k;
        float* col = dst + p * k * NR + c;
        for (int64_t i = 0; i < k; ++i) col[i * NR] = row[i];
      }
  });
  return out;
}

// x: [m, k] float32; panels: pack_panels of an [n, k] weight; bias: [n] or none -> [m, n]
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x must be a float32 [rows, k] matrix");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.size(1) == x.size(1) && panels.is_contiguous() &&
                  (n + NR - 1) / NR == panels.size(0),
              "panel_linear: panels must be pack_panels of an [n, k] weight with k = x.size(1)");
  const float* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == at::kFloat, "panel_linear: bias must be float32 [n]");
    bias_ptr = b.data_ptr<float>();
  }
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  auto out = at::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  if (m == 0) return out;
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel_rows(xp, pp + p * k * NR, m, k, yp + p * NR, n, std::min<int64_t>(NR, n - p * NR),
                 bias_ptr != nullptr ? bias_ptr + p * NR : nullptr);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner_kernels, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
