// The register tiles of the panel GEMM: y[m, cols] = x[m, k] B + bias where B is a run of panels,
// each 16 output columns (zero padded past n) for every k. Float32 panels are [k, 16]; bfloat16
// panels are [ceil(k / 2), 16, 2], k in pairs, what AVX512-BF16's dot product takes.
// - AVX512: a tile is up to 12 rows x 2 panels (24 accumulators of 16 floats), one load of each
//   panel per k (or k pair) shared by the rows; float32 by FMA, bfloat16 by vdpbf16ps into float32
//   accumulators, rounded to bfloat16 once at the store.
// - AVX2 (float32): 6 rows x 1 panel, 12 accumulators, 12 FMAs per 2 loads and 6 broadcasts.
// - Otherwise the same loop order, vectorised by the compiler.
// Rows past the last full tile take smaller tiles; one row a k-unrolled tile, on one panel at a time
// (one memory stream: a single row is bound by reading the panels).
#pragma once

#include <cstdint>
#include <algorithm>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define RW_PANEL_AVX512 1
#if defined(__AVX512BF16__)
#define RW_PANEL_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RW_PANEL_AVX2 1
#endif

namespace runner_kernels {

constexpr int64_t NR = 16;

#ifdef RW_PANEL_AVX512
constexpr int64_t PANELS_PER_TILE = 2;  // panels one tile covers (the threads split groups of these)

// float32 panels: one step is one k, 16 floats
struct F32 {
  using E = float;
  static constexpr int64_t K_PER_STEP = 1;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 bcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* y, __m512 c, int64_t ncols) {
    if (ncols >= NR) _mm512_storeu_ps(y, c);
    else if (ncols > 0) _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << ncols) - 1), c);
  }
};

#ifdef RW_PANEL_BF16
// bfloat16 panels: one step is a k pair, 16 columns x 2 (raw bfloat16 bits)
struct BF16 {
  using E = uint16_t;
  static constexpr int64_t K_PER_STEP = 2;
  static __m512 load(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 bcast(const uint16_t* x) {
    int32_t pair;
    __builtin_memcpy(&pair, x, sizeof(pair));
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }
  static void store(uint16_t* y, __m512 c, int64_t ncols) {
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(c);  // round to nearest even, as torch does
    if (ncols >= NR) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), v);
    else if (ncols > 0) _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << ncols) - 1), v);
  }
};
#endif

// MR (1..12) rows of x against NP (1 or 2) panels over `steps` steps; `bias`: NP * 16 floats.
// Named accumulators, not an array: GCC keeps an array of vectors on the stack.
template <class T, int MR, int NP>
inline void tile(const typename T::E* x, int64_t ldx, const typename T::E* p0, int64_t pstride, int64_t steps,
                 typename T::E* y, int64_t ldy, int64_t ncols, const float* bias) {
  constexpr int64_t S = NR * T::K_PER_STEP;  // elements per panel step
  const typename T::E* p1 = p0 + pstride;
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00, c80 = c00,
         c81 = c00, c90 = c00, c91 = c00, cA0 = c00, cA1 = c00, cB0 = c00, cB1 = c00;
  for (int64_t s = 0; s < steps; ++s) {
    const __m512 b0 = T::load(p0 + s * S);
    const __m512 b1 = NP > 1 ? T::load(p1 + s * S) : b0;
    __m512 a;
#define RW_ROW(R, I)                                      \
  if constexpr (MR > I) {                                 \
    a = T::bcast(x + I * ldx + s * T::K_PER_STEP);        \
    c##R##0 = T::fma(a, b0, c##R##0);                     \
    if constexpr (NP > 1) c##R##1 = T::fma(a, b1, c##R##1); \
  }
    RW_ROW(0, 0) RW_ROW(1, 1) RW_ROW(2, 2) RW_ROW(3, 3) RW_ROW(4, 4) RW_ROW(5, 5)
    RW_ROW(6, 6) RW_ROW(7, 7) RW_ROW(8, 8) RW_ROW(9, 9) RW_ROW(A, 10) RW_ROW(B, 11)
#undef RW_ROW
  }
  const __m512 bias0 = _mm512_loadu_ps(bias), bias1 = NP > 1 ? _mm512_loadu_ps(bias + NR) : bias0;
#define RW_OUT(R, I)                                                                     \
  if constexpr (MR > I) {                                                                \
    T::store(y + I * ldy, _mm512_add_ps(c##R##0, bias0), ncols);                         \
    if constexpr (NP > 1) T::store(y + I * ldy + NR, _mm512_add_ps(c##R##1, bias1), ncols - NR); \
  }
  RW_OUT(0, 0) RW_OUT(1, 1) RW_OUT(2, 2) RW_OUT(3, 3) RW_OUT(4, 4) RW_OUT(5, 5)
  RW_OUT(6, 6) RW_OUT(7, 7) RW_OUT(8, 8) RW_OUT(9, 9) RW_OUT(A, 10) RW_OUT(B, 11)
#undef RW_OUT
}

// one row: NP accumulator chains would wait on FMA latency, so steps are unrolled by 4 (4 NP accumulators)
template <class T, int NP>
inline void tile1(const typename T::E* x, const typename T::E* p0, int64_t pstride, int64_t steps,
                  typename T::E* y, int64_t ncols, const float* bias) {
  constexpr int64_t S = NR * T::K_PER_STEP, KS = T::K_PER_STEP;
  const typename T::E* p1 = p0 + pstride;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t s = 0;
  for (; s + 4 <= steps; s += 4) {
    const __m512 x0 = T::bcast(x + s * KS), x1 = T::bcast(x + (s + 1) * KS), x2 = T::bcast(x + (s + 2) * KS),
                 x3 = T::bcast(x + (s + 3) * KS);
    a0 = T::fma(x0, T::load(p0 + s * S), a0);
    a1 = T::fma(x1, T::load(p0 + (s + 1) * S), a1);
    a2 = T::fma(x2, T::load(p0 + (s + 2) * S), a2);
    a3 = T::fma(x3, T::load(p0 + (s + 3) * S), a3);
    if constexpr (NP > 1) {
      b0 = T::fma(x0, T::load(p1 + s * S), b0);
      b1 = T::fma(x1, T::load(p1 + (s + 1) * S), b1);
      b2 = T::fma(x2, T::load(p1 + (s + 2) * S), b2);
      b3 = T::fma(x3, T::load(p1 + (s + 3) * S), b3);
    }
  }
  for (; s < steps; ++s) {
    const __m512 xs = T::bcast(x + s * KS);
    a0 = T::fma(xs, T::load(p0 + s * S), a0);
    if constexpr (NP > 1) b0 = T::fma(xs, T::load(p1 + s * S), b0);
  }
  const __m512 sa = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  T::store(y, _mm512_add_ps(sa, _mm512_loadu_ps(bias)), ncols);
  if constexpr (NP > 1) {
    const __m512 sb = _mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3));
    T::store(y + NR, _mm512_add_ps(sb, _mm512_loadu_ps(bias + NR)), ncols - NR);
  }
}

template <class T, int NP>
inline void tile_rows(const typename T::E* x, const typename T::E* p0, int64_t pstride, int64_t m, int64_t k,
                      int64_t steps, typename T::E* y, int64_t ldy, int64_t ncols, const float* bias) {
  int64_t r = 0;
  for (; r + 12 <= m; r += 12) tile<T, 12, NP>(x + r * k, k, p0, pstride, steps, y + r * ldy, ldy, ncols, bias);
  const typename T::E* xr = x + r * k;
  typename T::E* yr = y + r * ldy;
  switch (m - r) {
#define RW_CASE(R) \
  case R: tile<T, R, NP>(xr, k, p0, pstride, steps, yr, ldy, ncols, bias); break;
    RW_CASE(11) RW_CASE(10) RW_CASE(9) RW_CASE(8) RW_CASE(7) RW_CASE(6) RW_CASE(5) RW_CASE(4) RW_CASE(3)
    RW_CASE(2)
#undef RW_CASE
    case 1: tile1<T, NP>(xr, p0, pstride, steps, yr, ncols, bias); break;
    default: break;
  }
}

// y[m, 16 * npanels (cut at ncols)] = x[m, k] (npanels panels from `panels`) + bias (ncols floats or
// null); x rows are k apart (k even for bfloat16), y rows ldy apart
template <class T>
inline void panel_gemm(const typename T::E* x, const typename T::E* panels, int64_t npanels, int64_t m, int64_t k,
                       typename T::E* y, int64_t ldy, int64_t ncols, const float* bias) {
  const int64_t steps = (k + T::K_PER_STEP - 1) / T::K_PER_STEP, pstride = steps * NR * T::K_PER_STEP;
  for (int64_t p = 0; p < npanels; p += 2) {
    alignas(64) float b[2 * NR] = {0};
    const int64_t cols = std::min<int64_t>(2 * NR, ncols - p * NR);
    if (bias != nullptr) std::copy(bias + p * NR, bias + p * NR + cols, b);
    if (npanels - p >= 2 && m > 1)
      tile_rows<T, 2>(x, panels + p * pstride, pstride, m, k, steps, y + p * NR, ldy, cols, b);
    else
      for (int64_t q = p; q < std::min(p + 2, npanels); ++q)  // one row: one panel stream at a time
        tile_rows<T, 1>(x, panels + q * pstride, pstride, m, k, steps, y + q * NR, ldy,
                        std::min<int64_t>(NR, ncols - q * NR), b + (q - p) * NR);
  }
}

// float32, one panel ([k, 16]): y[m, ncols] = x[m, k] B + bias
inline void panel_rows(const float* x, const float* panel, int64_t m, int64_t k, float* y, int64_t ldy, int64_t ncols,
                       const float* bias) {
  panel_gemm<F32>(x, panel, 1, m, k, y, ldy, ncols, bias);
}

#elif defined(RW_PANEL_AVX2)
constexpr int64_t PANELS_PER_TILE = 1;

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
constexpr int64_t PANELS_PER_TILE = 1;

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

#ifndef RW_PANEL_AVX512
struct F32 {
  using E = float;
};

// y[m, 16 * npanels (cut at ncols)] = x[m, k] (npanels [k, 16] panels) + bias (ncols floats or null)
template <class T>
inline void panel_gemm(const float* x, const float* panels, int64_t npanels, int64_t m, int64_t k, float* y,
                       int64_t ldy, int64_t ncols, const float* bias) {
  for (int64_t p = 0; p < npanels; ++p)
    panel_rows(x, panels + p * k * NR, m, k, y + p * NR, ldy, std::min<int64_t>(NR, ncols - p * NR),
               bias != nullptr ? bias + p * NR : nullptr);
}
#endif

}  // namespace runner_kernels
