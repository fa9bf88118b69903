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

namespace {

template <typename T>
void decode_kernel(T* out, const T* q, const T* k, const T* v, const int64_t* block_tables,
                   const int64_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale,
                   int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores, row_max(group), inv_sum(group);
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
      scores.resize(group * n);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* kp = kh + (table[pos / block_size] * block_size + pos % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < head_dim; ++x) dot += qg[x] * static_cast<float>(kp[x]);
          scores[g * n + t] = dot;
          row_max[g] = std::max(row_max[g], dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float sum = 0.f;
        float* sg = scores.data() + g * n;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - row_max[g]);
          sum += sg[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* vp = vh + (table[pos / block_size] * block_size + pos % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc.data() + g * head_dim;
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
