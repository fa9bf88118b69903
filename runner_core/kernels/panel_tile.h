// The register tiles of the panel GEMM for the tier being compiled (tier.cpp): y[m, cols] = x[m, k] B
// + bias, B a run of panels of 16 output columns (zero padded past n) for every k. Float32 panels are
// [k, 16]; bfloat16 panels are [ceil(k / 2), 16, 2], k in pairs, so one 32-bit lane holds a column's
// two k values: AVX512-BF16's dot product takes the pair as it is, every other tier widens it to two
// float32 in registers (the low half shifted up 16 bits, the high half masked). Bfloat16 is read as
// bfloat16 and multiplied in float32, with no float32 copy in memory; outputs round once at the store.
// - AVX512: up to 12 rows x 2 panels (24 accumulators of 16 floats), one load of each panel step
//   shared by the rows.
// - AVX2: 6 rows (float32) or 4 rows (bfloat16, a k pair taken as two float32 half-steps, x widened
//   once per call; 5 or 6 rows ran at half the speed) x 1 panel, two accumulators of 8 floats per row.
// - plain: the same loop order, vectorised by the compiler.
// One row takes a tile unrolled over k, on one panel at a time (one memory stream: a single row is
// bound by reading the panels; on AVX2 it prefetches 16 KiB ahead, which a core alone did not do).
#pragma once

namespace runner_kernels::RW_TIER {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// round to nearest even, as torch does (a NaN stays a quiet NaN)
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int64_t PANELS_PER_TILE = 2;  // panels one tile covers (the threads split groups of these)

struct F32 {
  using E = float;
  using X = float;
  using V = __m512;
  static constexpr int64_t K_PER_STEP = 1;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V bcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(V a, V b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* y, __m512 c, int64_t ncols) {
    if (ncols >= NR) _mm512_storeu_ps(y, c);
    else if (ncols > 0) _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << ncols) - 1), c);
  }
};

inline __m512i pair_bits(const uint16_t* x) {
  int32_t pair;
  __builtin_memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// 16 floats rounded to bfloat16, round to nearest even (NaN: quiet NaN)
inline __m256i round_bf16(__m512 c) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(c);
#else
  const __m512i u = _mm512_castps_si512(c);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

struct BF16Store {
  static void store(uint16_t* y, __m512 c, int64_t ncols) {
    const __m256i v = round_bf16(c);
    if (ncols >= NR) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), v);
    else if (ncols > 0) _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << ncols) - 1), v);
  }
};

#if defined(__AVX512BF16__)
// bfloat16 in hardware: one step is a k pair of 16 columns (raw bits), vdpbf16ps into float32
struct BF16 : BF16Store {
  using E = uint16_t;
  using X = uint16_t;
  using V = __m512;
  static constexpr int64_t K_PER_STEP = 2;
  static V load(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static V bcast(const uint16_t* x) { return _mm512_castsi512_ps(pair_bits(x)); }
  static __m512 fma(V a, V b, __m512 c) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }
};
#else
// bfloat16 widened in registers: a k pair becomes two float32 vectors (k even, k odd)
struct Pair512 {
  __m512 even, odd;
};
inline Pair512 widen(__m512i bits) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))))};
}
struct BF16 : BF16Store {
  using E = uint16_t;
  using X = uint16_t;
  using V = Pair512;
  static constexpr int64_t K_PER_STEP = 2;
  static V load(const uint16_t* p) { return widen(_mm512_loadu_si512(p)); }
  static V bcast(const uint16_t* x) { return widen(pair_bits(x)); }
  static __m512 fma(V a, V b, __m512 c) { return _mm512_fmadd_ps(a.odd, b.odd, _mm512_fmadd_ps(a.even, b.even, c)); }
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
    const typename T::V b0 = T::load(p0 + s * S);
    const typename T::V b1 = NP > 1 ? T::load(p1 + s * S) : b0;
#define RW_ROW(R, I)                                                   \
  if constexpr (MR > I) {                                              \
    const typename T::V a = T::bcast(x + I * ldx + s * T::K_PER_STEP); \
    c##R##0 = T::fma(a, b0, c##R##0);                                  \
    if constexpr (NP > 1) c##R##1 = T::fma(a, b1, c##R##1);            \
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
    const typename T::V x0 = T::bcast(x + s * KS), x1 = T::bcast(x + (s + 1) * KS), x2 = T::bcast(x + (s + 2) * KS),
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
    const typename T::V xs = T::bcast(x + s * KS);
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
inline void panel_gemm(const typename T::X* x, const typename T::E* panels, int64_t npanels, int64_t m, int64_t k,
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

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t PANELS_PER_TILE = 1;

// float32: a step is one k; its 16 columns are two vectors (columns 0-7, 8-15)
struct F32 {
  using E = float;
  using X = float;  // x as the tile reads it
  static constexpr int64_t K_PER_STEP = 1, MR = 6;
  static __m256 load0(const float* p, int) { return _mm256_loadu_ps(p); }
  static __m256 load1(const float* p, int) { return _mm256_loadu_ps(p + 8); }
  static void store(float* y, __m256 lo, __m256 hi, int64_t ncols) {
    if (ncols == NR) return _mm256_storeu_ps(y, lo), _mm256_storeu_ps(y + 8, hi);
    alignas(32) float tmp[NR];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    std::copy(tmp, tmp + ncols, y);
  }
};

// bfloat16: a step is a k pair, two float32 half-steps (k even, then k odd): the panel's 8 columns'
// pairs widen to the even (low half shifted up) or odd (high half masked) floats; x comes widened
inline __m256 widen(const uint16_t* p, int odd) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(odd ? _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)))
                                 : _mm256_slli_epi32(bits, 16));
}
inline __m256i round_bf16(__m256 c) {  // 8 floats to bfloat16 in the low halves of 8 lanes
  const __m256i u = _mm256_castps_si256(c);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(c, c, _CMP_UNORD_Q)));
}
struct BF16 {
  using E = uint16_t;
  using X = float;
  static constexpr int64_t K_PER_STEP = 2, MR = 4;
  static __m256 load0(const uint16_t* p, int odd) { return widen(p, odd); }
  static __m256 load1(const uint16_t* p, int odd) { return widen(p + 16, odd); }
  static void store(uint16_t* y, __m256 lo, __m256 hi, int64_t ncols) {
    // packus interleaves 128-bit lanes: put columns 0-15 back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xd8);
    if (ncols == NR) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), packed);
    alignas(32) uint16_t tmp[NR];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
    std::copy(tmp, tmp + ncols, y);
  }
};

// MR (1..T::MR) rows of x against one panel, a step's half-steps (one k each) in turn. Named
// accumulators, not an array: GCC keeps an array of __m256 on the stack, which halves the speed.
template <class T, int MR>
inline void tile(const float* x, int64_t ldx, const typename T::E* panel, int64_t steps, typename T::E* y,
                 int64_t ldy, int64_t ncols, __m256 bias_lo, __m256 bias_hi) {
  constexpr int64_t S = NR * T::K_PER_STEP, KS = T::K_PER_STEP;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t s = 0; s < steps; ++s)
    for (int j = 0; j < KS; ++j) {
      const __m256 b0 = T::load0(panel + s * S, j), b1 = T::load1(panel + s * S, j);
#define RW_ROW(R)                                                     \
  if constexpr (MR > R) {                                             \
    const __m256 a = _mm256_broadcast_ss(x + R * ldx + s * KS + j);   \
    c##R##0 = _mm256_fmadd_ps(a, b0, c##R##0);                        \
    c##R##1 = _mm256_fmadd_ps(a, b1, c##R##1);                        \
  }
      RW_ROW(0) RW_ROW(1) RW_ROW(2) RW_ROW(3) RW_ROW(4) RW_ROW(5)
#undef RW_ROW
    }
#define RW_OUT(R) \
  if constexpr (MR > R) \
    T::store(y + R * ldy, _mm256_add_ps(c##R##0, bias_lo), _mm256_add_ps(c##R##1, bias_hi), ncols);
  RW_OUT(0) RW_OUT(1) RW_OUT(2) RW_OUT(3) RW_OUT(4) RW_OUT(5)
#undef RW_OUT
}

// one row: a 2-accumulator chain would wait on FMA latency, so steps are unrolled by 4 (8 accumulators)
template <class T>
inline void tile1(const float* x, const typename T::E* panel, int64_t steps, typename T::E* y, int64_t ncols,
                  __m256 bias_lo, __m256 bias_hi) {
  constexpr int64_t S = NR * T::K_PER_STEP, KS = T::K_PER_STEP;
  __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, h0 = l0, h1 = l0, h2 = l0, h3 = l0;
  int64_t s = 0;
  for (; s + 4 <= steps; s += 4) {
    const typename T::E* p = panel + s * S;
    const float* xs = x + s * KS;
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p) + (16 << 10) + 64 * l, _MM_HINT_T0);
    for (int j = 0; j < KS; ++j) {
      l0 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + j), T::load0(p, j), l0);
      h0 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + j), T::load1(p, j), h0);
      l1 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + KS + j), T::load0(p + S, j), l1);
      h1 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + KS + j), T::load1(p + S, j), h1);
      l2 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + 2 * KS + j), T::load0(p + 2 * S, j), l2);
      h2 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + 2 * KS + j), T::load1(p + 2 * S, j), h2);
      l3 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + 3 * KS + j), T::load0(p + 3 * S, j), l3);
      h3 = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + 3 * KS + j), T::load1(p + 3 * S, j), h3);
    }
  }
  for (; s < steps; ++s)
    for (int j = 0; j < KS; ++j) {
      l0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + s * KS + j), T::load0(panel + s * S, j), l0);
      h0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + s * KS + j), T::load1(panel + s * S, j), h0);
    }
  const __m256 lo = _mm256_add_ps(_mm256_add_ps(l0, l1), _mm256_add_ps(l2, l3));
  const __m256 hi = _mm256_add_ps(_mm256_add_ps(h0, h1), _mm256_add_ps(h2, h3));
  T::store(y, _mm256_add_ps(lo, bias_lo), _mm256_add_ps(hi, bias_hi), ncols);
}

template <class T>
inline void panel_rows(const float* x, const typename T::E* panel, int64_t m, int64_t k, typename T::E* y,
                       int64_t ldy, int64_t ncols, const float* bias) {
  const int64_t steps = (k + T::K_PER_STEP - 1) / T::K_PER_STEP;
  alignas(32) float b[NR] = {0};
  if (bias != nullptr) std::copy(bias, bias + ncols, b);
  const __m256 blo = _mm256_load_ps(b), bhi = _mm256_load_ps(b + 8);
  int64_t r = 0;
  for (; r + T::MR <= m; r += T::MR) tile<T, T::MR>(x + r * k, k, panel, steps, y + r * ldy, ldy, ncols, blo, bhi);
  const float* xr = x + r * k;
  typename T::E* yr = y + r * ldy;
  switch (m - r) {
    case 5: tile<T, 5>(xr, k, panel, steps, yr, ldy, ncols, blo, bhi); break;
    case 4: tile<T, 4>(xr, k, panel, steps, yr, ldy, ncols, blo, bhi); break;
    case 3: tile<T, 3>(xr, k, panel, steps, yr, ldy, ncols, blo, bhi); break;
    case 2: tile<T, 2>(xr, k, panel, steps, yr, ldy, ncols, blo, bhi); break;
    case 1: tile1<T>(xr, panel, steps, yr, ncols, blo, bhi); break;
    default: break;
  }
}

#else
constexpr int64_t PANELS_PER_TILE = 1;

// without AVX2 and FMA (the plain tier, and other ISAs): the same loop order, vectorised by the compiler
struct F32 {
  using E = float;
  using X = float;
  static constexpr int64_t K_PER_STEP = 1;
  static void step(const float* x, const float* p, float* acc) {
    const float a = *x;
#pragma omp simd
    for (int64_t c = 0; c < NR; ++c) acc[c] += a * p[c];
  }
  static float out(float v) { return v; }
};

struct BF16 {
  using E = uint16_t;
  using X = float;
  static constexpr int64_t K_PER_STEP = 2;
  static void step(const float* x, const uint16_t* p, float* acc) {
    const float a0 = x[0], a1 = x[1];
#pragma omp simd
    for (int64_t c = 0; c < NR; ++c) acc[c] += a0 * bf16_to_float(p[2 * c]) + a1 * bf16_to_float(p[2 * c + 1]);
  }
  static uint16_t out(float v) { return float_to_bf16(v); }
};

template <class T>
inline void panel_rows(const typename T::X* x, const typename T::E* panel, int64_t m, int64_t k, typename T::E* y,
                       int64_t ldy, int64_t ncols, const float* bias) {
  const int64_t steps = (k + T::K_PER_STEP - 1) / T::K_PER_STEP;
  for (int64_t r = 0; r < m; ++r) {
    float acc[NR] = {0};
    for (int64_t s = 0; s < steps; ++s) T::step(x + r * k + s * T::K_PER_STEP, panel + s * NR * T::K_PER_STEP, acc);
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = T::out(acc[c] + (bias != nullptr ? bias[c] : 0.f));
  }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__))
// y[m, 16 * npanels (cut at ncols)] = x[m, k] (npanels panels) + bias (ncols floats or null)
template <class T>
inline void panel_gemm(const typename T::X* x, const typename T::E* panels, int64_t npanels, int64_t m, int64_t k,
                       typename T::E* y, int64_t ldy, int64_t ncols, const float* bias) {
  const int64_t pstride = (k + T::K_PER_STEP - 1) / T::K_PER_STEP * NR * T::K_PER_STEP;
  for (int64_t p = 0; p < npanels; ++p)
    panel_rows<T>(x, panels + p * pstride, m, k, y + p * NR, ldy, std::min<int64_t>(NR, ncols - p * NR),
                  bias != nullptr ? bias + p * NR : nullptr);
}
#endif

// float32, one panel ([k, 16]): y[m, ncols] = x[m, k] B + bias (attention's products)
inline void panel_rows_f32(const float* x, const float* panel, int64_t m, int64_t k, float* y, int64_t ldy,
                           int64_t ncols, const float* bias) {
  panel_gemm<F32>(x, panel, 1, m, k, y, ldy, ncols, bias);
}

}  // namespace runner_kernels::RW_TIER
