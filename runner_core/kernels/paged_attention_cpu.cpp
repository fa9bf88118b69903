// Paged attention for decode on the CPU: one query token per sequence, keys and values
// read in place from the KV pool through the block table (no gathered copy), softmax in
// float32. Registered as the torch op runner_kernels::paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

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

template <typename T>
void decode_kernel(T* out, const T* q, const T* k, const T* v, const int64_t* block_tables,
                   const int64_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale,
                   int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  int64_t max_n = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    max_n = std::max(max_n, window > 0 ? std::min(context_lens[s], window) : context_lens[s]);
  // every thread's scratch, allocated here: a buffer allocated inside a worker thread lands in that
  // thread's own malloc arena, which keeps its pages after the model is unloaded
  const int64_t per_thread = 2 * group * head_dim + 2 * group + group * max_n;
  std::vector<float> scratch(at::get_num_threads() * per_thread);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    float* const qf = scratch.data() + at::get_thread_num() * per_thread;
    float* const acc = qf + group * head_dim;
    float* const row_max = acc + group * head_dim;
    float* const inv_sum = row_max + group;
    float* const scores = inv_sum + group;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = context_lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = block_tables + s * max_blocks;
      const T* kh = k + h * num_slots * head_dim;
      const T* vh = v + h * num_slots * head_dim;
      const T* qh = q + (s * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(qh[i]) * scale;
      std::fill(row_max, row_max + group, -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* kp = kh + (table[pos / block_size] * block_size + pos % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < head_dim; ++x) dot += qg[x] * static_cast<float>(kp[x]);
          scores[g * n + t] = dot;
          row_max[g] = std::max(row_max[g], dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) inv_sum[g] = 1.f / exp_shifted(scores + g * n, n, row_max[g]);
      std::fill(acc, acc + group * head_dim, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* vp = vh + (table[pos / block_size] * block_size + pos % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc + g * head_dim;
#pragma omp simd
          for (int64_t x = 0; x < head_dim; ++x) ag[x] += p * static_cast<float>(vp[x]);
        }
      }
      T* oh = out + (s * num_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < head_dim; ++x) oh[g * head_dim + x] = static_cast<T>(acc[g * head_dim + x] * inv_sum[g]);
    }
  });
}

// out, q: [seqs, heads, head_dim]; k_cache, v_cache: [kv_heads, slots, head_dim];
// block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64 (keys 0..len-1 are attended).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-D");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), q.size(0),
                            q.size(1), k_cache.size(0), q.size(2), k_cache.size(1), bt.size(1), block_size,
                            static_cast<float>(scale), sliding_window);
  });
}

}  // namespace

TORCH_LIBRARY(runner_kernels, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
