// y = x W^T + b over a prepacked W, in float32 or (with AVX512-BF16) bfloat16 with float32
// accumulation: the weight [n, k] is stored as panels of 16 output columns, [ceil(n / 16), k, 16]
// floats or [ceil(n / 16), ceil(k / 2), 32] bfloat16 (k in pairs), zero padded, so for each k (pair)
// one panel gives 64 contiguous bytes. The register tiles are in panel_tile.h. The threads split the
// panels, so every panel is read from memory once per call and reused from cache by all rows.
// Registered as runner_kernels::pack_panels, runner_kernels::panel_linear and
// runner_kernels::panels_support.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>

#include "panel_tile.h"

namespace {

using runner_kernels::NR;
using runner_kernels::PANELS_PER_TILE;

// whether this build multiplies panels of `dtype` (registered as panels_support)
bool supported(at::ScalarType dtype) {
#ifdef RW_PANEL_BF16
  if (dtype == at::kBFloat16) return true;
#endif
  return dtype == at::kFloat;
}

// k values per panel step: 1 (float32) or 2 (bfloat16)
int64_t k_per_step(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

template <class E>
void pack(const E* src, E* dst, int64_t n, int64_t k, int64_t kps, int64_t panels) {
  const int64_t steps = (k + kps - 1) / kps, stride = steps * NR * kps;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < NR && p * NR + c < n; ++c) {
        const E* row = src + (p * NR + c) * k;
        E* col = dst + p * stride + c * kps;
        for (int64_t i = 0; i < k; ++i) col[(i / kps) * NR * kps + i % kps] = row[i];
      }
  });
}

// weight [n, k] -> [ceil(n / 16), k, 16] (float32) or [ceil(n / 16), ceil(k / 2), 32] (bfloat16)
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: a [n, k] weight");
  TORCH_CHECK(supported(weight.scalar_type()), "pack_panels: no panel kernel for ", weight.scalar_type(),
              " on this CPU (float32 always; bfloat16 needs AVX512-BF16)");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR, kps = k_per_step(w.scalar_type());
  const int64_t steps = (k + kps - 1) / kps;
  // its own pages (mmap, zero-filled): freed with the model they go straight back to the system. From
  // malloc they would raise glibc's mmap threshold and the next model's tensors would stay in the heap
  // after an unload (tests/test_unload_memory.py)
  const size_t bytes = std::max<size_t>(1, panels * steps * NR * kps * w.element_size());
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mem != MAP_FAILED, "pack_panels: cannot map ", bytes, " bytes for the panels");
  auto out = at::from_blob(mem, {panels, steps, NR * kps}, [bytes](void* p) { munmap(p, bytes); }, w.options());
  if (kps == 1)
    pack(w.data_ptr<float>(), out.data_ptr<float>(), n, k, kps, panels);
  else
    pack(reinterpret_cast<const uint16_t*>(w.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), n, k, kps,
         panels);
  return out;
}

template <class T>
void run(const at::Tensor& x, const at::Tensor& panels, int64_t n, const float* bias, at::Tensor& out) {
  using E = typename T::E;
  const int64_t m = x.size(0), k = x.size(1), count = panels.size(0);
  const E* xp = reinterpret_cast<const E*>(x.data_ptr());
  const E* pp = reinterpret_cast<const E*>(panels.data_ptr());
  E* yp = reinterpret_cast<E*>(out.data_ptr());
  const int64_t stride = panels.size(1) * panels.size(2), groups = (count + PANELS_PER_TILE - 1) / PANELS_PER_TILE;
  // rows in blocks of ~256 KiB of x, each against all of this thread's panels: a block stays in L2
  // while the panels stream past it (a whole prefill's x would not fit beside a panel)
  const int64_t block = std::max<int64_t>(12, (256 << 10) / (k * static_cast<int64_t>(sizeof(E))) / 12 * 12);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; r += block)
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * PANELS_PER_TILE;
        runner_kernels::panel_gemm<T>(xp + r * k, pp + p * stride, std::min(PANELS_PER_TILE, count - p),
                                      std::min(block, m - r), k, yp + r * n + p * NR, n, n - p * NR,
                                      bias != nullptr ? bias + p * NR : nullptr);
      }
  });
}

// x: [m, k] in the panels' dtype; panels: pack_panels of an [n, k] weight; bias: [n] or none -> [m, n]
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias) {
  const auto dtype = panels.scalar_type();
  const int64_t kps = k_per_step(dtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && supported(dtype),
              "panel_linear: x must be a [rows, k] matrix in the panels' dtype (float32, or bfloat16 with AVX512-BF16)");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR * kps && panels.size(1) == (x.size(1) + kps - 1) / kps &&
                  panels.is_contiguous() && (n + NR - 1) / NR == panels.size(0),
              "panel_linear: panels must be pack_panels of an [n, k] weight with k = x.size(1)");
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == dtype, "panel_linear: bias must be [n] in x's dtype");
    b = bias->to(at::kFloat).contiguous();
  }
  auto xc = x.contiguous();
  if (xc.size(1) % kps != 0) xc = at::constant_pad_nd(xc, {0, kps - xc.size(1) % kps});  // whole k pairs
  auto out = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) == 0) return out;
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
#ifdef RW_PANEL_BF16
  if (dtype == at::kBFloat16) {
    run<runner_kernels::BF16>(xc, panels, n, bias_ptr, out);
    return out;
  }
#endif
  run<runner_kernels::F32>(xc, panels, n, bias_ptr, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner_kernels, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("panels_support(ScalarType dtype) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
