// The register tiles of the quantized GEMM for the tier being compiled (tier.cpp): y[m, cols] = x[m, k]
// W^T + bias over one panel of 16 output columns stored as int8 (per-column scale) or int4 (a scale and
// a minimum per column and group of k), x in float32. The stored bytes are read and widened to float32
// in registers (no dequantized copy of the weight in memory) and the products accumulate in float32:
// - int8: acc += x[k] * q[k]; the column's scale is applied once, at the store (with the bias).
// - int4: per group acc_g += x[k] * q[k]; acc += scale_g * acc_g + min_g * sum_g(x), the sum of x over
//   the group computed once per row and group (tier.cpp) and shared by every column.
// A tile of MR rows widens each panel step once and multiplies it into all its rows (what makes m > 1
// fast); one row takes a tile unrolled over k (independent accumulator chains), prefetching ahead.
// x comes widened to float32 (once per call, dispatch.cpp); on AVX512-BF16 a bfloat16 x is multiplied as
// it is, a k pair per vdpbf16ps (exact products): int8 from two rows (one row is faster widened), int4 from
// one (its nibbles become the bfloat16 128 + q by integer ops alone, u4_pairs; 128 sum(x) taken off per group).
// The arithmetic is float32 x float32: VNNI's int8 dot products would need the activations quantized to
// int8 too (W8A8), which is another numeric result than these weight-only formats give, so none is used.
// QV is the tier's vector: AVX512 (16 floats), AVX2 (8), plain (16, vectorised by the compiler).
#pragma once

namespace runner_kernels::RW_TIER {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct QV {
  using F = __m512;
  static constexpr int W = 16, MR8 = 12, MR4 = 8;  // tile rows: int8, int4 (three accumulators a row)
  static F zero() { return _mm512_setzero_ps(); }
  static F bcast(float a) { return _mm512_set1_ps(a); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // W bytes, one column's k pair each: the even k (low nibble) and the odd k (high nibble)
  static void u4(const uint8_t* p, F& even, F& odd) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    even = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  static void store(float* y, F c, int64_t ncols) { F32::store(y, c, ncols); }
  static void store(uint16_t* y, F c, int64_t ncols) { BF16Store::store(y, c, ncols); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct QV {
  using F = __m256;
  static constexpr int W = 8, MR8 = 6, MR4 = 4;
  static F zero() { return _mm256_setzero_ps(); }
  static F bcast(float a) { return _mm256_set1_ps(a); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, F& even, F& odd) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    even = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  static void store(float* y, F c, int64_t ncols) {
    if (ncols >= W) return _mm256_storeu_ps(y, c);
    alignas(32) float tmp[W];
    _mm256_store_ps(tmp, c);
    std::copy(tmp, tmp + std::max<int64_t>(ncols, 0), y);
  }
  static void store(uint16_t* y, F c, int64_t ncols) {
    const __m128i v = _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(c), _mm256_setzero_si256()), 0xd8));
    if (ncols >= W) return _mm_storeu_si128(reinterpret_cast<__m128i*>(y), v);
    alignas(16) uint16_t tmp[W];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), v);
    std::copy(tmp, tmp + std::max<int64_t>(ncols, 0), y);
  }
};
#else
struct QV {
  struct F {
    float v[16];
  };
  static constexpr int W = 16, MR8 = 4, MR4 = 4;
  static F zero() { return F{}; }
  static F bcast(float a) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = a;
    return r;
  }
  static F load(const float* p) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static F add(F a, F b) {
#pragma omp simd
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static F fma(F a, F b, F c) {
#pragma omp simd
    for (int i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static F i8(const int8_t* p) {
    F r;
#pragma omp simd
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static void u4(const uint8_t* p, F& even, F& odd) {
#pragma omp simd
    for (int i = 0; i < W; ++i) {
      even.v[i] = static_cast<float>(p[i] & 15);
      odd.v[i] = static_cast<float>(p[i] >> 4);
    }
  }
  static void store(float* y, F c, int64_t ncols) { std::copy(c.v, c.v + std::clamp<int64_t>(ncols, 0, W), y); }
  static void store(uint16_t* y, F c, int64_t ncols) {
    for (int64_t i = 0; i < std::min<int64_t>(ncols, W); ++i) y[i] = float_to_bf16(c.v[i]);
  }
};
#endif

constexpr int QNV = NR / QV::W;  // vectors per panel step
constexpr int64_t QPREFETCH = 16 << 10;  // bytes ahead the one-row tiles prefetch
using QF = QV::F;

inline void qprefetch(const void* p) {
#if defined(__x86_64__)
  _mm_prefetch(static_cast<const char*>(p) + QPREFETCH, _MM_HINT_T0);
#else
  __builtin_prefetch(static_cast<const char*>(p) + QPREFETCH);
#endif
}

// what every tile ends with: y[r] = acc[r] * scale + bias (scale: int8's per column; int4's 1)
template <class O, int MR>
inline void qstore(QF (&c)[MR][QNV], const float* scale, const float* bias, O* y, int64_t ldy, int64_t ncols) {
  for (int v = 0; v < QNV; ++v) {
    const QF s = scale != nullptr ? QV::load(scale + v * QV::W) : QV::bcast(1.f), b = QV::load(bias + v * QV::W);
    for (int r = 0; r < MR; ++r) QV::store(y + r * ldy + v * QV::W, QV::fma(c[r][v], s, b), ncols - v * QV::W);
  }
}

// int8, MR rows (ldx apart) x one panel ([k, 16] bytes)
template <class O, int MR>
inline void tile_i8(const float* x, int64_t ldx, const int8_t* q, int64_t k, const float* scale, const float* bias,
                    O* y, int64_t ldy, int64_t ncols) {
  QF c[MR][QNV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < QNV; ++v) c[r][v] = QV::zero();
  for (int64_t s = 0; s < k; ++s) {
    QF w[QNV];
    for (int v = 0; v < QNV; ++v) w[v] = QV::i8(q + s * NR + v * QV::W);
    for (int r = 0; r < MR; ++r) {
      const QF a = QV::bcast(x[r * ldx + s]);
      for (int v = 0; v < QNV; ++v) c[r][v] = QV::fma(a, w[v], c[r][v]);
    }
  }
  qstore<O, MR>(c, scale, bias, y, ldy, ncols);
}

// int8, one row: four chains over k (a single chain would wait on the FMA latency)
template <class O>
inline void row_i8(const float* x, const int8_t* q, int64_t k, const float* scale, const float* bias, O* y,
                   int64_t ncols) {
  QF c[4][QNV];
  for (int u = 0; u < 4; ++u)
    for (int v = 0; v < QNV; ++v) c[u][v] = QV::zero();
  int64_t s = 0;
  for (; s + 4 <= k; s += 4) {
    qprefetch(q + s * NR);
    for (int u = 0; u < 4; ++u) {
      const QF a = QV::bcast(x[s + u]);
      for (int v = 0; v < QNV; ++v) c[u][v] = QV::fma(a, QV::i8(q + (s + u) * NR + v * QV::W), c[u][v]);
    }
  }
  for (; s < k; ++s)
    for (int v = 0; v < QNV; ++v) c[0][v] = QV::fma(QV::bcast(x[s]), QV::i8(q + s * NR + v * QV::W), c[0][v]);
  QF sum[1][QNV];
  for (int v = 0; v < QNV; ++v) sum[0][v] = QV::add(QV::add(c[0][v], c[1][v]), QV::add(c[2][v], c[3][v]));
  qstore<O, 1>(sum, scale, bias, y, 0, ncols);
}

// int4, MR rows x one panel ([k / 2, 16] bytes; scales and mins [groups, 16]); xsum: [MR, groups], ldxs
// apart. One vector of columns at a time (AVX2's panel is two): a row's two accumulators per vector then
// leave registers for more rows sharing each widened step.
template <class O, int MR>
inline void tile_i4(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* q,
                    const float* scales, const float* mins, int64_t k, int64_t group, const float* bias, O* y,
                    int64_t ldy, int64_t ncols) {
  for (int v = 0; v < QNV; ++v) {
    const int64_t o = v * QV::W;
    QF c[MR];
    for (int r = 0; r < MR; ++r) c[r] = QV::zero();
    for (int64_t g = 0; g * group < k; ++g) {
      QF ae[MR], ao[MR];  // even and odd k apart: one chain of FMAs each, not two in a row
      for (int r = 0; r < MR; ++r) ae[r] = ao[r] = QV::zero();
      for (int64_t j = g * group / 2; j < (g + 1) * group / 2; ++j) {
        QF even, odd;
        QV::u4(q + j * NR + o, even, odd);
        for (int r = 0; r < MR; ++r) {
          ae[r] = QV::fma(QV::bcast(x[r * ldx + 2 * j]), even, ae[r]);
          ao[r] = QV::fma(QV::bcast(x[r * ldx + 2 * j + 1]), odd, ao[r]);
        }
      }
      const QF s = QV::load(scales + g * NR + o), mn = QV::load(mins + g * NR + o);
      for (int r = 0; r < MR; ++r)
        c[r] = QV::fma(mn, QV::bcast(xsum[r * ldxs + g]), QV::fma(s, QV::add(ae[r], ao[r]), c[r]));
    }
    const QF b = QV::load(bias + o);
    for (int r = 0; r < MR; ++r) QV::store(y + r * ldy + o, QV::add(c[r], b), ncols - o);
  }
}

// int4, one row: per group, four chains (two k pairs, even and odd k) folded into the row's sum
template <class O>
inline void row_i4(const float* x, const float* xsum, const uint8_t* q, const float* scales, const float* mins,
                   int64_t k, int64_t group, const float* bias, O* y, int64_t ncols) {
  QF c[1][QNV];
  for (int v = 0; v < QNV; ++v) c[0][v] = QV::zero();
  for (int64_t g = 0; g * group < k; ++g) {
    QF a[4][QNV];
    for (int u = 0; u < 4; ++u)
      for (int v = 0; v < QNV; ++v) a[u][v] = QV::zero();
    for (int64_t j = g * group / 2; j < (g + 1) * group / 2; j += 2) {  // group is a multiple of 4 (32, 64, 128)
      qprefetch(q + j * NR);
      for (int u = 0; u < 2; ++u) {
        const QF xe = QV::bcast(x[2 * (j + u)]), xo = QV::bcast(x[2 * (j + u) + 1]);
        for (int v = 0; v < QNV; ++v) {
          QF even, odd;
          QV::u4(q + (j + u) * NR + v * QV::W, even, odd);
          a[2 * u][v] = QV::fma(xe, even, a[2 * u][v]);
          a[2 * u + 1][v] = QV::fma(xo, odd, a[2 * u + 1][v]);
        }
      }
    }
    const QF xs = QV::bcast(xsum[g]);
    for (int v = 0; v < QNV; ++v) {
      const QF acc = QV::add(QV::add(a[0][v], a[1][v]), QV::add(a[2][v], a[3][v]));
      c[0][v] = QV::fma(QV::load(mins + g * NR + v * QV::W), xs,
                        QV::fma(QV::load(scales + g * NR + v * QV::W), acc, c[0][v]));
    }
  }
  qstore<O, 1>(c, nullptr, bias, y, 0, ncols);
}

#if defined(__AVX512BF16__)
// bfloat16 x on AVX512-BF16: a k pair of 16 columns in one vdpbf16ps per row. The stored integers are
// exact in bfloat16 and x is bfloat16 already, so every product is exact and the sums are float32, as in
// the widened path. int8 takes it from two rows (one row is faster widened: see tile_i8_dp), int4 from one.
constexpr int MR_DP = 12;

// two vectors of integer-valued floats -> bfloat16 pairs (even k in the low half of each 32-bit lane):
// exact by truncation, a float of at most 8 significant bits being its own bfloat16 in the high half
inline __m512bh qpairs(__m512 even, __m512 odd) {
  return (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                           _mm512_castps_si512(odd));
}

// int4: 16 bytes (16 columns' k pair) -> the bfloat16 pairs (128 + even nibble, 128 + odd nibble), with no
// conversion: 0x4300 | n is the bfloat16 of 128 + n (n < 128: [128, 256) has a step of 1). Four integer ops
// where widening through float32 takes seven; the 128 x added per k is taken off once per group (I4_OFFSET).
constexpr float I4_OFFSET = 128.f;
inline __m512bh u4_pairs(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // (b | b << 12) & 0x000F000F: the even nibble in bits 0-3, the odd one in bits 16-19
  const __m512i n = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  return (__m512bh)_mm512_or_si512(n, _mm512_set1_epi32(0x43004300));
}

// a group's sum over (128 + q) x -> its share of y: scale (acc - 128 xsum) + min xsum
inline QF i4_group(QF acc, QF scale, QF min, float xsum, QF c) {
  return QV::fma(_mm512_fnmadd_ps(QV::bcast(I4_OFFSET), scale, min), QV::bcast(xsum), QV::fma(scale, acc, c));
}

template <class O, int MR>
inline void tile_i8_dp(const uint16_t* x, int64_t ldx, const int8_t* q, int64_t k, const float* scale,
                       const float* bias, O* y, int64_t ldy, int64_t ncols) {
  QF c[MR][1];
  for (int r = 0; r < MR; ++r) c[r][0] = QV::zero();
  for (int64_t s = 0; s < k; s += 2) {
    const __m512bh w = qpairs(QV::i8(q + s * NR), QV::i8(q + (s + 1) * NR));
    for (int r = 0; r < MR; ++r) c[r][0] = _mm512_dpbf16_ps(c[r][0], (__m512bh)pair_bits(x + r * ldx + s), w);
  }
  qstore<O, MR>(c, scale, bias, y, ldy, ncols);
}

template <class O, int MR>
inline void tile_i4_dp(const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* q,
                       const float* scales, const float* mins, int64_t k, int64_t group, const float* bias, O* y,
                       int64_t ldy, int64_t ncols) {
  QF c[MR][1];
  for (int r = 0; r < MR; ++r) c[r][0] = QV::zero();
  for (int64_t g = 0; g * group < k; ++g) {
    QF a[MR];
    for (int r = 0; r < MR; ++r) a[r] = QV::zero();
    for (int64_t j = g * group / 2; j < (g + 1) * group / 2; ++j) {
      const __m512bh w = u4_pairs(q + j * NR);
      for (int r = 0; r < MR; ++r) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)pair_bits(x + r * ldx + 2 * j), w);
    }
    const QF s = QV::load(scales + g * NR), mn = QV::load(mins + g * NR);
    for (int r = 0; r < MR; ++r) c[r][0] = i4_group(a[r], s, mn, xsum[r * ldxs + g], c[r][0]);
  }
  qstore<O, MR>(c, nullptr, bias, y, ldy, ncols);
}

// int4, one row: four chains (four k pairs) per group, prefetching ahead
template <class O>
inline void row_i4_dp(const uint16_t* x, const float* xsum, const uint8_t* q, const float* scales, const float* mins,
                      int64_t k, int64_t group, const float* bias, O* y, int64_t ncols) {
  QF c[1][1] = {{QV::zero()}};
  for (int64_t g = 0; g * group < k; ++g) {
    QF a[4] = {QV::zero(), QV::zero(), QV::zero(), QV::zero()};
    const int64_t end = (g + 1) * group / 2;
    int64_t j = g * group / 2;
    for (; j + 4 <= end; j += 4) {
      qprefetch(q + j * NR);
      for (int u = 0; u < 4; ++u)
        a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)pair_bits(x + 2 * (j + u)), u4_pairs(q + (j + u) * NR));
    }
    for (; j < end; ++j) a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)pair_bits(x + 2 * j), u4_pairs(q + j * NR));
    const QF acc = QV::add(QV::add(a[0], a[1]), QV::add(a[2], a[3]));
    c[0][0] = i4_group(acc, QV::load(scales + g * NR), QV::load(mins + g * NR), xsum[g], c[0][0]);
  }
  qstore<O, 1>(c, nullptr, bias, y, 0, ncols);
}
#endif

// f(rows, r) for rows [0, m) in tiles: `rows` (std::integral_constant) is MR, then the m % MR left
template <int R, class F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (R >= 1) {
    if (rows == R)
      f(std::integral_constant<int, R>{});
    else
      with_rows<R - 1>(rows, f);
  }
}

template <int MR, class F>
inline void over_rows(int64_t m, const F& f) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) f(std::integral_constant<int, MR>{}, r);
  with_rows<MR - 1>(m - r, [&](auto rows) { f(rows, r); });
}

// rows [r0, r0 + m) of x (xsum: the group sums of x's rows, int4) against panel p: tiles of the tier's
// MR rows, then one of the rest (one row: the row tile); bias: the panel's 16 floats
template <class O>
inline void quant_panel_rows(const QuantArgs& a, const float* xsum, int64_t r0, int64_t m, int64_t p,
                             const float* bias) {
  const int64_t k = a.k, ldy = a.n, ncols = std::min<int64_t>(NR, a.n - p * NR);
  const float* x = a.x + r0 * k;
  O* y = static_cast<O*>(a.y) + r0 * ldy + p * NR;
#if defined(__AVX512BF16__)
  const bool dp = a.x_bf16 != nullptr && k % 2 == 0;
  const uint16_t* x16 = a.x_bf16 + r0 * k;
#endif
  if (a.group == 0) {
    const int8_t* q = static_cast<const int8_t*>(a.qpanels) + p * k * NR;
    const float* scale = a.scales + p * NR;
    const auto tile = [&](auto rows, int64_t r) {
      constexpr int R = decltype(rows)::value;
      if constexpr (R == 1) {
        row_i8<O>(x + r * k, q, k, scale, bias, y + r * ldy, ncols);
      } else {
#if defined(__AVX512BF16__)
        if (dp) return tile_i8_dp<O, R>(x16 + r * k, k, q, k, scale, bias, y + r * ldy, ldy, ncols);
#endif
        if constexpr (R <= QV::MR8) tile_i8<O, R>(x + r * k, k, q, k, scale, bias, y + r * ldy, ldy, ncols);
      }
    };
#if defined(__AVX512BF16__)
    if (dp && m > 1) return over_rows<MR_DP>(m, tile);
#endif
    return over_rows<QV::MR8>(m, tile);
  }
  const int64_t groups = k / a.group;
  const uint8_t* q = static_cast<const uint8_t*>(a.qpanels) + p * (k / 2) * NR;
  const float* scales = a.scales + p * groups * NR;
  const float* mins = a.mins + p * groups * NR;
  const float* xs = xsum + r0 * groups;
  const auto tile = [&](auto rows, int64_t r) {
    constexpr int R = decltype(rows)::value;
    if constexpr (R == 1) {
#if defined(__AVX512BF16__)
      if (dp) return row_i4_dp<O>(x16 + r * k, xs + r * groups, q, scales, mins, k, a.group, bias, y + r * ldy, ncols);
#endif
      row_i4<O>(x + r * k, xs + r * groups, q, scales, mins, k, a.group, bias, y + r * ldy, ncols);
    } else {
#if defined(__AVX512BF16__)
      if (dp)
        return tile_i4_dp<O, R>(x16 + r * k, k, xs + r * groups, groups, q, scales, mins, k, a.group, bias,
                                y + r * ldy, ldy, ncols);
#endif
      if constexpr (R <= QV::MR4)
        tile_i4<O, R>(x + r * k, k, xs + r * groups, groups, q, scales, mins, k, a.group, bias, y + r * ldy, ldy,
                      ncols);
    }
  };
#if defined(__AVX512BF16__)
  if (dp) return over_rows<MR_DP>(m, tile);
#endif
  over_rows<QV::MR4>(m, tile);
}

}  // namespace runner_kernels::RW_TIER
