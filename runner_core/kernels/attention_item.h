// One work item of paged attention for the tier being compiled (tier.cpp): up to RUN_TOKENS query
// tokens of one sequence and one KV head, so the grouped query heads and the run's tokens share every
// key read. The keys [first, last len) are copied out of their blocks into 16-key panels, scores =
// Q K^T and out = P V run on the panel GEMM's register tile (panel_tile.h), with a float32 softmax
// between them. A decode item (one token) on AVX2 or AVX512 reads its keys and values in place
// instead: a copy would cost more than its few rows of products. Cache rows of any element type
// (float32, float64, bfloat16, float16) are widened to float32 as they are read.
#pragma once

namespace runner_kernels::RW_TIER {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float f16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man x 2^-24
    return sign != 0 ? -f : f;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

inline uint16_t float_to_f16(float f) {  // round to nearest even
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | 0x7c00 | (u > 0x7f800000u ? 0x200 : 0);  // inf, NaN
  if (u >= 0x477ff000u) return sign | 0x7c00;  // rounds past 65504
  if (u < 0x38800000u) {                        // below 2^-14: a subnormal, in units of 2^-24
    float a;
    __builtin_memcpy(&a, &u, sizeof(a));
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  uint32_t h = (u - (112u << 23)) >> 13;
  const uint32_t rest = u & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(Bf16 x) { return bf16_to_float(x.bits); }
inline float to_float(F16 x) { return f16_to_float(x.bits); }
inline void store_float(float* d, float x) { *d = x; }
inline void store_float(double* d, float x) { *d = x; }
inline void store_float(Bf16* d, float x) { d->bits = float_to_bf16(x); }
inline void store_float(F16* d, float x) { d->bits = float_to_f16(x); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// W floats of a cache row, whatever its element type
constexpr int64_t W = 16;
using VF = __m512;
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VF vload(const Bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline VF vload(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vset1(float a) { return _mm512_set1_ps(a); }
inline VF vzero() { return _mm512_setzero_ps(); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline float vsum(VF v) { return _mm512_reduce_add_ps(v); }
#define RW_DIRECT 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t W = 8;
using VF = __m256;
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vload(const Bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline VF vload(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vset1(float a) { return _mm256_set1_ps(a); }
inline VF vzero() { return _mm256_setzero_ps(); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline float vsum(VF v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#define RW_DIRECT 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
// e^x for 8 floats: x = n ln2 + r, e^r by Cephes' degree-6 polynomial (relative error ~1e-7), 2^n
// through the exponent bits. glibc's scalar exp made the softmax half of this kernel's time.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// s[t] = e^(s[t] - max) for t < n; returns their sum
inline float exp_shifted(float* s, int64_t n, float max) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(max);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - max);
    sum += s[t];
  }
  return sum;
}

// the pool slot of a sequence's position, through its block table
inline int64_t slot_of(const int64_t* table, int64_t pos, int64_t block_size) {
  return table[pos / block_size] * block_size + pos % block_size;
}

#ifdef RW_DIRECT
template <typename T>
bool direct_ok(int64_t tokens, int64_t d) {
  return !std::is_same_v<T, double> && tokens == 1 && d % NR == 0 && d <= 16 * W;
}

template <typename T>
VF vload_any(const T* p) {
  if constexpr (std::is_same_v<T, double>) return vzero();  // never taken (direct_ok)
  else return vload(p);
}

// sc[r * kp + t] = q_r . k_(lo + t), r < rows, t < n
template <typename T>
void direct_scores(const float* qm, int64_t rows, const T* kh, const int64_t* table, int64_t lo, int64_t n,
                   int64_t d, int64_t block_size, float* sc, int64_t kp) {
  const int64_t vecs = d / W;
  VF kv[16];
  for (int64_t t = 0; t < n; ++t) {
    const T* kr = kh + slot_of(table, lo + t, block_size) * d;
    for (int64_t c = 0; c < vecs; ++c) kv[c] = vload_any(kr + c * W);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = qm + r * d;
      VF a0 = vmul(vload(qr), kv[0]), a1 = vzero();
      int64_t c = 1;
      for (; c + 1 < vecs; c += 2) {
        a0 = vfma(vload(qr + c * W), kv[c], a0);
        a1 = vfma(vload(qr + (c + 1) * W), kv[c + 1], a1);
      }
      if (c < vecs) a0 = vfma(vload(qr + c * W), kv[c], a0);
      sc[r * kp + t] = vsum(vadd(a0, a1));
    }
  }
}

// acc[r * d + x] = sum_t sc[r * kp + t] v_(lo + t)[x]
template <typename T>
void direct_values(const float* sc, int64_t rows, int64_t kp, const T* vh, const int64_t* table, int64_t lo,
                   int64_t n, int64_t d, int64_t block_size, float* acc) {
  std::fill(acc, acc + rows * d, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* vr = vh + slot_of(table, lo + t, block_size) * d;
    for (int64_t c = 0; c < d; c += W) {
      const VF vv = vload_any(vr + c);
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc + r * d + c;
        vstore(a, vfma(vset1(sc[r * kp + t]), vv, vload(a)));
      }
    }
  }
}
#else
template <typename T>
bool direct_ok(int64_t, int64_t) { return false; }
template <typename T>
void direct_scores(const float*, int64_t, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*,
                   int64_t) {}
template <typename T>
void direct_values(const float*, int64_t, int64_t, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                   float*) {}
#endif

// rows r0 .. r0 + tokens - 1 (one sequence) against KV head h; work: attention_scratch_floats of them
template <typename T>
void run_item(const AttentionArgs& a, int64_t r0, int64_t tokens, int64_t h, float* work) {
  const T* q = static_cast<const T*>(a.q);
  T* out = static_cast<T*>(a.out);
  const int64_t* lens = a.lens;
  const int64_t* table = a.tables + a.row_seq[r0] * a.max_blocks;
  const int64_t g = a.heads / a.kv_heads, d = a.dim, rows = tokens * g;
  auto first_of = [&](int64_t len) { return a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0; };
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = 0; i < tokens; ++i) {
    lo = std::min(lo, first_of(lens[r0 + i]));
    hi = std::max(hi, lens[r0 + i]);
  }
  const int64_t n = hi - lo, kp = (n + NR - 1) / NR * NR, dpanels = (d + NR - 1) / NR;
  float* qm = work;                       // [rows, d]: scaled queries, row (token i, head g)
  float* sc = qm + rows * d;              // [rows, kp]: scores, then probabilities
  float* kpan = sc + rows * kp;           // [kp / 16, d, 16]: keys as panels
  float* vpan = kpan + kp * d;            // [dpanels, kp, 16]: values as panels
  float* acc = vpan + dpanels * NR * kp;  // [rows, dpanels * 16]
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const T* src = q + ((r0 + i) * a.heads + h * g + j) * d;
      for (int64_t x = 0; x < d; ++x) qm[(i * g + j) * d + x] = to_float(src[x]) * a.scale;
    }
  const T* kh = static_cast<const T*>(a.k) + h * a.slots * d;
  const T* vh = static_cast<const T*>(a.v) + h * a.slots * d;
  const bool direct = direct_ok<T>(tokens, d);
  if (direct) {
    direct_scores(qm, rows, kh, table, lo, n, d, a.block_size, sc, kp);
  } else {
    // zero what the copies below leave: the last key panel's tail, the value rows past n, and the
    // last value panel's columns past d
    std::fill(kpan + (n / NR) * d * NR, kpan + kp * d, 0.f);
    for (int64_t p = 0; p < dpanels; ++p) std::fill(vpan + (p * kp + n) * NR, vpan + (p + 1) * kp * NR, 0.f);
    if (d % NR != 0) std::fill(vpan + (dpanels - 1) * kp * NR, vpan + dpanels * kp * NR, 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = slot_of(table, lo + t, a.block_size);
      const T* kr = kh + slot * d;
      const T* vr = vh + slot * d;
      float* kc = kpan + (t / NR) * d * NR + t % NR;
      for (int64_t x = 0; x < d; ++x) kc[x * NR] = to_float(kr[x]);
      for (int64_t x = 0; x < d; ++x) vpan[(x / NR) * kp * NR + t * NR + x % NR] = to_float(vr[x]);
    }
    for (int64_t p = 0; p < kp / NR; ++p) panel_rows_f32(qm, kpan + p * d * NR, rows, d, sc + p * NR, kp, NR, nullptr);
  }
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t len = lens[r0 + i], lo_i = first_of(len) - lo, hi_i = len - lo;
    for (int64_t j = 0; j < g; ++j) {
      float* row = sc + (i * g + j) * kp;
      const float mx = *std::max_element(row + lo_i, row + hi_i);
      const float inv = 1.f / exp_shifted(row + lo_i, hi_i - lo_i, mx);
      std::fill(row, row + lo_i, 0.f);
      std::fill(row + hi_i, row + kp, 0.f);
      for (int64_t t = lo_i; t < hi_i; ++t) row[t] *= inv;
    }
  }
  if (direct)
    direct_values(sc, rows, kp, vh, table, lo, n, d, a.block_size, acc);  // acc rows are d = dpanels * 16 apart
  else
    for (int64_t p = 0; p < dpanels; ++p)
      panel_rows_f32(sc, vpan + p * kp * NR, rows, kp, acc + p * NR, dpanels * NR, NR, nullptr);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < g; ++j) {
      T* dst = out + ((r0 + i) * a.heads + h * g + j) * d;
      const float* src = acc + (i * g + j) * dpanels * NR;
      for (int64_t x = 0; x < d; ++x) store_float(dst + x, src[x]);
    }
}

}  // namespace runner_kernels::RW_TIER
