// The register tile shared by the float32 kernels: y[m, ncols] = x[m, k] B + bias where B is one
// panel, [k, 16] floats (16 output columns per k, zero padded past ncols). 6 rows x 16 columns are
// 12 AVX2 accumulators, 12 FMAs per 2 loads and 6 broadcasts; rows past the last multiple of 6 take
// smaller tiles, one row a k-unrolled tile with 8 accumulators.
#pragma once

#include <cstdint>
#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RW_PANEL_AVX2 1
#endif

namespace runner_kernels {

constexpr int64_t NR = 16;

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

inline void panel_rows(const float* x, const float* panel, int64_t m, int64_t k, float* y, int64_t ldy, int64_t ncols,
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
inline void panel_rows(const float* x, const float* panel, int64_t m, int64_t k, float* y, int64_t ldy, int64_t ncols,
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


}  // namespace runner_kernels
