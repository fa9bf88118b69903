// Paged attention on the CPU over the KV pool in place, for any mix of decode and prefill rows: each
// query row names its sequence's block table and its context length, and attends to keys
// [len - window, len) of that sequence (causal by construction: a prefill token's length is its
// position + 1). Consecutive rows of one sequence form a run; a work item is up to 32 tokens of a run
// and one KV head, so the grouped query heads and the run's tokens share every key read. Per item:
// the keys [first, last len) are copied out of their blocks into 16-key panels, scores = Q K^T and
// out = P V run on the register tile of the GEMM kernel (panel_tile.h), with a float32 softmax
// between them. A decode item (one token) on AVX512 reads its keys and values in place instead: a
// copy would cost more than its few rows of products. The threads take items dynamically.
// Registered as runner_kernels::paged_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "panel_tile.h"

namespace {

using runner_kernels::NR;
using runner_kernels::panel_rows;

// tokens of one run per work item: the item's keys are copied into panels once for all its rows, so
// longer runs amortise the copy (prefill chunks), at the price of masked scores near the diagonal
constexpr int64_t RUN_TOKENS = 32;

#if defined(__AVX2__) && defined(__FMA__)
#define RW_EXP_AVX2 1
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
#ifdef RW_EXP_AVX2
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

struct Shape {
  int64_t heads, kv_heads, group, dim, slots, max_blocks, block_size, window;
  float scale;
};

// scratch floats one work item of `rows` query rows (tokens x group) over up to `keys` keys needs
int64_t scratch_floats(const Shape& sh, int64_t rows, int64_t keys) {
  const int64_t kp = (keys + NR - 1) / NR * NR, dp = (sh.dim + NR - 1) / NR * NR;
  return rows * sh.dim + rows * kp + kp * sh.dim + dp * kp + rows * dp;
}

// the pool slot of a sequence's position, through its block table
inline int64_t slot_of(const int64_t* table, int64_t pos, int64_t block_size) {
  return table[pos / block_size] * block_size + pos % block_size;
}

#ifdef RW_PANEL_AVX512
// A decode item (one token, a few query rows) reads its keys and values in place: copying them into
// panels would cost more than the products. 16 floats of a cache row, whatever its dtype.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const double*) { return _mm512_setzero_ps(); }  // never taken (direct_ok)

template <typename T>
bool direct_ok(int64_t tokens, int64_t d) {
  return !std::is_same_v<T, double> && tokens == 1 && d % NR == 0 && d <= 16 * NR;
}

// sc[r * kp + t] = q_r . k_(lo + t), r < rows, t < n
template <typename T>
void direct_scores(const float* qm, int64_t rows, const T* kh, const int64_t* table, int64_t lo, int64_t n,
                   const Shape& sh, float* sc, int64_t kp) {
  const int64_t d = sh.dim, vecs = d / NR;
  __m512 kv[16];
  for (int64_t t = 0; t < n; ++t) {
    const T* kr = kh + slot_of(table, lo + t, sh.block_size) * d;
    for (int64_t c = 0; c < vecs; ++c) kv[c] = load16(kr + c * NR);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = qm + r * d;
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]), a1 = _mm512_setzero_ps();
      int64_t c = 1;
      for (; c + 1 < vecs; c += 2) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + c * NR), kv[c], a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + (c + 1) * NR), kv[c + 1], a1);
      }
      if (c < vecs) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + c * NR), kv[c], a0);
      sc[r * kp + t] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
  }
}

// acc[r * d + x] = sum_t sc[r * kp + t] v_(lo + t)[x]
template <typename T>
void direct_values(const float* sc, int64_t rows, int64_t kp, const T* vh, const int64_t* table, int64_t lo,
                   int64_t n, const Shape& sh, float* acc) {
  const int64_t d = sh.dim;
  std::fill(acc, acc + rows * d, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* vr = vh + slot_of(table, lo + t, sh.block_size) * d;
    for (int64_t c = 0; c < d; c += NR) {
      const __m512 vv = load16(vr + c);
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc + r * d + c;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(sc[r * kp + t]), vv, _mm512_loadu_ps(a)));
      }
    }
  }
}
#else
template <typename T>
bool direct_ok(int64_t, int64_t) { return false; }
template <typename T>
void direct_scores(const float*, int64_t, const T*, const int64_t*, int64_t, int64_t, const Shape&, float*, int64_t) {}
template <typename T>
void direct_values(const float*, int64_t, int64_t, const T*, const int64_t*, int64_t, int64_t, const Shape&, float*) {}
#endif

template <typename T>
void run_item(T* out, const T* q, const T* k, const T* v, const int64_t* table, const int64_t* lens, int64_t r0,
              int64_t tokens, int64_t h, const Shape& sh, float* work) {
  const int64_t g = sh.group, d = sh.dim, rows = tokens * g;
  auto first_of = [&](int64_t len) { return sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0; };
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = 0; i < tokens; ++i) {
    lo = std::min(lo, first_of(lens[r0 + i]));
    hi = std::max(hi, lens[r0 + i]);
  }
  const int64_t n = hi - lo, kp = (n + NR - 1) / NR * NR, dpanels = (d + NR - 1) / NR;
  float* qm = work;                   // [rows, d]: scaled queries, row (token i, head g)
  float* sc = qm + rows * d;          // [rows, kp]: scores, then probabilities
  float* kpan = sc + rows * kp;       // [kp / 16, d, 16]: keys as panels
  float* vpan = kpan + kp * d;        // [dpanels, kp, 16]: values as panels
  float* acc = vpan + dpanels * NR * kp;  // [rows, dpanels * 16]
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const T* src = q + ((r0 + i) * sh.heads + h * g + j) * d;
      for (int64_t x = 0; x < d; ++x) qm[(i * g + j) * d + x] = static_cast<float>(src[x]) * sh.scale;
    }
  const T* kh = k + h * sh.slots * d;
  const T* vh = v + h * sh.slots * d;
  const bool direct = direct_ok<T>(tokens, d);
  if (direct) {
    direct_scores(qm, rows, kh, table, lo, n, sh, sc, kp);
  } else {
    // zero what the copies below leave: the last key panel's tail, the value rows past n, and the
    // last value panel's columns past d
    std::fill(kpan + (n / NR) * d * NR, kpan + kp * d, 0.f);
    for (int64_t p = 0; p < dpanels; ++p) std::fill(vpan + (p * kp + n) * NR, vpan + (p + 1) * kp * NR, 0.f);
    if (d % NR != 0) std::fill(vpan + (dpanels - 1) * kp * NR, vpan + dpanels * kp * NR, 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = slot_of(table, lo + t, sh.block_size);
      const T* kr = kh + slot * d;
      const T* vr = vh + slot * d;
      float* kc = kpan + (t / NR) * d * NR + t % NR;
      for (int64_t x = 0; x < d; ++x) kc[x * NR] = static_cast<float>(kr[x]);
      for (int64_t x = 0; x < d; ++x) vpan[(x / NR) * kp * NR + t * NR + x % NR] = static_cast<float>(vr[x]);
    }
    for (int64_t p = 0; p < kp / NR; ++p)
      panel_rows(qm, kpan + p * d * NR, rows, d, sc + p * NR, kp, NR, nullptr);
  }
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t len = lens[r0 + i], a = first_of(len) - lo, b = len - lo;
    for (int64_t j = 0; j < g; ++j) {
      float* row = sc + (i * g + j) * kp;
      const float mx = *std::max_element(row + a, row + b);
      const float inv = 1.f / exp_shifted(row + a, b - a, mx);
      std::fill(row, row + a, 0.f);
      std::fill(row + b, row + kp, 0.f);
      for (int64_t t = a; t < b; ++t) row[t] *= inv;
    }
  }
  if (direct)
    direct_values(sc, rows, kp, vh, table, lo, n, sh, acc);  // acc rows are d = dpanels * 16 apart
  else
    for (int64_t p = 0; p < dpanels; ++p)
      panel_rows(sc, vpan + p * kp * NR, rows, kp, acc + p * NR, dpanels * NR, NR, nullptr);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < g; ++j) {
      T* dst = out + ((r0 + i) * sh.heads + h * g + j) * d;
      const float* src = acc + (i * g + j) * dpanels * NR;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(src[x]);
    }
}

// items differ in cost (a prefill's later tokens see more keys): the threads take them one at a
// time (dynamic), where at::parallel_for would hand each thread a fixed range
template <typename T>
void run_items(T* out, const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* seq,
               const int64_t* lens, const std::vector<std::pair<int64_t, int64_t>>& chunks, const Shape& sh,
               float* scratch, int64_t per_thread) {
  const int64_t items = static_cast<int64_t>(chunks.size()) * sh.kv_heads;
  const int threads =
      at::in_parallel_region() ? 1 : static_cast<int>(std::clamp<int64_t>(items, 1, at::get_num_threads()));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    const auto [r0, tokens] = chunks[item / sh.kv_heads];
    run_item(out, q, k, v, tables + seq[r0] * sh.max_blocks, lens, r0, tokens, item % sh.kv_heads, sh,
             scratch + omp_get_thread_num() * per_thread);
  }
}

// out, q: [rows, heads, dim]; k_cache, v_cache: [kv_heads, slots, dim]; block_tables: [seqs, max_blocks];
// row_seq, context_lens: [rows] int64 (the row's block table, and keys 0..len-1 are its sequence's)
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& context_lens,
                     int64_t block_size, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-D");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  row_seq.scalar_type() == at::kLong,
              "block_tables, row_seq and context_lens must be int64");
  TORCH_CHECK(row_seq.numel() == q.size(0) && context_lens.numel() == q.size(0),
              "row_seq and context_lens need one entry per query row");
  const auto bt = block_tables.contiguous(), rs = row_seq.contiguous(), cl = context_lens.contiguous();
  const Shape sh{q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0), q.size(2), k_cache.size(1), bt.size(1),
                 block_size, sliding_window, static_cast<float>(scale)};
  const int64_t* seq = rs.data_ptr<int64_t>();
  const int64_t* lens = cl.data_ptr<int64_t>();
  // work items: (first row, tokens) chunks of runs of one sequence, times the KV heads
  std::vector<std::pair<int64_t, int64_t>> chunks;
  int64_t most = 0, max_len = 0;
  for (int64_t r = 0, n = q.size(0); r < n;) {
    int64_t e = r + 1;
    while (e < n && e - r < RUN_TOKENS && seq[e] == seq[r]) ++e;
    chunks.emplace_back(r, e - r);
    most = std::max(most, e - r);
    for (int64_t i = r; i < e; ++i) max_len = std::max(max_len, lens[i]);
    r = e;
  }
  const int64_t keys = sliding_window > 0 ? std::min(max_len, sliding_window + RUN_TOKENS) : max_len;
  const int64_t per_thread = scratch_floats(sh, most * sh.group, keys);
  // allocated here: a buffer allocated inside a worker thread lands in that thread's own malloc
  // arena, which keeps its pages after the model is unloaded
  std::vector<float> scratch(at::get_num_threads() * per_thread);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kp = k_cache.data_ptr<scalar_t>();
    const auto* vp = v_cache.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    const int64_t* tables = bt.data_ptr<int64_t>();
    run_items(op, qp, kp, vp, tables, seq, lens, chunks, sh, scratch.data(), per_thread);
  });
}

}  // namespace

TORCH_LIBRARY(runner_kernels, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor row_seq, Tensor context_lens, int block_size, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) { m.impl("paged_attention", &paged_attention); }
