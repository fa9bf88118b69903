// Greedy sampling's argmax over float32 logits rows, as torch.argmax defines it (the first index of
// the maximum; a row holding NaN gives its first NaN), at memory speed: torch's CPU argmax takes
// ~0.6 ms for 32 rows of a 32k vocabulary, a tenth of a decode step. Two passes per row, both from
// cache: the maximum (vector), then the first index that equals it. The threads split the rows.
// Registered as runner_kernels::argmax_rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int64_t first_equal_or_nan(const float* x, int64_t n, float target, bool nan) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(target);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == target) return i;
  return 0;  // unreachable: the target is in the row
}

int64_t row_argmax(const float* x, int64_t n) {
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
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return first_equal_or_nan(x, n, best, nan);
}

// logits: [rows, vocab] float32 -> [rows] int64
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits must be a float32 [rows, vocab] matrix with vocab > 0");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner_kernels, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
