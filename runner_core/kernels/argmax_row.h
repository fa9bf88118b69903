// Greedy sampling's argmax of one float32 row for the tier being compiled (tier.cpp), as torch.argmax
// defines it: the first index of the maximum; a row holding NaN gives its first NaN. Two passes, both
// from cache: the maximum (vector), then the first index that equals it.
#pragma once

namespace runner_kernels::RW_TIER {

inline int64_t first_equal_or_nan(const float* x, int64_t n, float target, bool nan) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(target);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 t = _mm256_set1_ps(target);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == target) return i;
  return 0;  // unreachable: the target is in the row
}

inline int64_t row_argmax(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  best = _mm512_reduce_max_ps(m);
  nan = unordered != 0;
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float lane : lanes) best = std::max(best, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return first_equal_or_nan(x, n, best, nan);
}

}  // namespace runner_kernels::RW_TIER
