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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RW_PANEL_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;

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

#ifdef RW_PANEL_AVX2
inline void store(float* y, __m256 lo, __m256 hi, __m256 bias_lo, __m256 bias_hi, int64_t ncols) {
  lo = _mm256_add_ps(lo, bias_lo);
  hi = _mm256_add_ps(hi, bias_hi);
  if (ncols == NR) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float tmp[NR];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::copy(tmp, tmp + ncols, y);
}

// MR (1..6) rows of x against one panel. Named accumulators, not an array: GCC keeps an array of
// __m256 on the stack, which halves the speed.
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldy, int64_t ncols,
                 __m256 bias_lo, __m256 bias_hi) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero, c30 = zero, c31 = zero,
         c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 b0 = _mm256_loadu_ps(panel + i * NR), b1 = _mm256_loadu_ps(panel + i * NR + 8);
    __m256 a;
#define RW_ROW(R)                                      \
  if constexpr (MR > R) {                              \
    a = _mm256_broadcast_ss(x##R + i);                 \
    c##R##0 = _mm256_fmadd_ps(a, b0, c##R##0);         \
    c##R##1 = _mm256_fmadd_ps(a, b1, c##R##1);         \
  }
    RW_ROW(0) RW_ROW(1) RW_ROW(2) RW_ROW(3) RW_ROW(4) RW_ROW(5)
#undef RW_ROW
  }
#define RW_OUT(R) \
  if constexpr (MR > R) store(y + R * ldy, c##R##0, c##R##1, bias_lo, bias_hi, ncols);
  RW_OUT(0) RW_OUT(1) RW_OUT(2) RW_OUT(3) RW_OUT(4) RW_OUT(5)
#undef RW_OUT
}

// one row: a 2-accumulator chain would wait on FMA latency, so k is unrolled by 4 (8 accumulators)
inline void tile1(const float* x, const float* panel, int64_t k, float* y, int64_t ncols, __m256 bias_lo,
                  __m256 bias_hi) {
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 4 <= k; i += 4)
    for (int u = 0; u < 4; ++u) {
      const __m256 a = _mm256_broadcast_ss(x + i + u);
      s[2 * u] = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + (i + u) * NR), s[2 * u]);
      s[2 * u + 1] = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + (i + u) * NR + 8), s[2 * u + 1]);
    }
  for (; i < k; ++i) {
    const __m256 a = _mm256_broadcast_ss(x + i);
    s[0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + i * NR), s[0]);
    s[1] = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + i * NR + 8), s[1]);
  }
  store(y, _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[4], s[6])),
        _mm256_add_ps(_mm256_add_ps(s[1], s[3]), _mm256_add_ps(s[5], s[7])), bias_lo, bias_hi, ncols);
}

void panel_rows(const float* x, const float* panel, int64_t m, int64_t k, float* y, int64_t ldy, int64_t ncols,
                const float* bias) {
  alignas(32) float b[NR] = {0};
  if (bias != nullptr) std::copy(bias, bias + ncols, b);
  const __m256 blo = _mm256_load_ps(b), bhi = _mm256_load_ps(b + 8);
  int64_t r = 0;
  for (; r + 6 <= m; r += 6) tile<6>(x + r * k, k, panel, k, y + r * ldy, ldy, ncols, blo, bhi);
  const float* xr = x + r * k;
  float* yr = y + r * ldy;
  switch (m - r) {
    case 5: tile<5>(xr, k, panel, k, yr, ldy, ncols, blo, bhi); break;
    case 4: tile<4>(xr, k, panel, k, yr, ldy, ncols, blo, bhi); break;
    case 3: tile<3>(xr, k, panel, k, yr, ldy, ncols, blo, bhi); break;
    case 2: tile<2>(xr, k, panel, k, yr, ldy, ncols, blo, bhi); break;
    case 1: tile1(xr, panel, k, yr, ncols, blo, bhi); break;
    default: break;
  }
}

#else
// without AVX2 and FMA (another ISA): the same loop order, vectorised by the compiler
void panel_rows(const float* x, const float* panel, int64_t m, int64_t k, float* y, int64_t ldy, int64_t ncols,
                const float* bias) {
  for (int64_t r = 0; r < m; ++r) {
    float acc[NR] = {0};
    for (int64_t i = 0; i < k; ++i) {
      const float a = x[r * k + i];
#pragma omp simd
      for (int64_t c = 0; c < NR; ++c) acc[c] += a * panel[i * NR + c];
    }
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = acc[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}
#endif

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
