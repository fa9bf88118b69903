// The kernels of one instruction-set tier. build.py compiles this file once per tier with that tier's
// -m flags and three names: RW_TIER (the namespace everything here lives in), RW_TABLE (the function
// returning this tier's KernelTable) and RW_TIER_NAME (its name). The dispatcher (dispatch.cpp) picks
// one table at run time from the CPU's features. Threads: OpenMP, the pool torch's ops use, with the
// count the dispatcher passes (torch's); inside another parallel region a call runs on one thread.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tier.h"

#if !defined(RW_TIER) || !defined(RW_TABLE) || !defined(RW_TIER_NAME)
#error "tier.cpp is compiled by runner_core/kernels/build.py, which names the tier"
#endif

#include "panel_tile.h"
#include "quant_tile.h"
#include "attention_item.h"
#include "argmax_row.h"

namespace runner_kernels::RW_TIER {
namespace {

// f(begin, end) over [0, n) in contiguous ranges, one per thread (as at::parallel_for splits)
template <class F>
void parallel_ranges(int64_t n, int threads, const F& f) {
  if (n <= 0) return;
  const int t = omp_in_parallel() ? 1 : static_cast<int>(std::clamp<int64_t>(n, 1, threads));
  if (t == 1) {
    f(0, n);
    return;
  }
  const int64_t chunk = (n + t - 1) / t;
#pragma omp parallel num_threads(t)
  {
    const int64_t begin = omp_get_thread_num() * chunk;
    if (begin < n) f(begin, std::min(n, begin + chunk));
  }
}

// The threads split the panels, so every panel is read from memory once per call and reused from
// cache by all rows; rows go in blocks of ~1 MiB of x, each against all of a thread's panels (a block
// is reused from L2 or L3 while the panels stream past it; 256 KiB blocks re-streamed the panels of
// a large k too often: docs/benchmarks.md). Where the tile reads x as float32 (bfloat16 on AVX2), x
// is widened once here.
template <class T>
void panel_linear(const typename T::E* x_in, const typename T::E* panels, int64_t m, int64_t k, int64_t n,
                  const float* bias, typename T::E* y, int threads) {
  using X = typename T::X;
  std::vector<X> widened;
  const X* x = reinterpret_cast<const X*>(x_in);
  if constexpr (!std::is_same_v<X, typename T::E>) {
    widened.resize(m * k);
    for (int64_t i = 0; i < m * k; ++i) widened[i] = bf16_to_float(x_in[i]);
    x = widened.data();
  }
  const int64_t count = (n + NR - 1) / NR, steps = (k + T::K_PER_STEP - 1) / T::K_PER_STEP;
  const int64_t stride = steps * NR * T::K_PER_STEP, groups = (count + PANELS_PER_TILE - 1) / PANELS_PER_TILE;
  const int64_t block = std::max<int64_t>(12, (1 << 20) / (k * static_cast<int64_t>(sizeof(X))) / 12 * 12);
  parallel_ranges(groups, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; r += block)
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * PANELS_PER_TILE;
        panel_gemm<T>(x + r * k, panels + p * stride, std::min(PANELS_PER_TILE, count - p), std::min(block, m - r),
                      k, y + r * n + p * NR, n, n - p * NR, bias != nullptr ? bias + p * NR : nullptr);
      }
  });
}

void panel_linear_f32(const float* x, const float* panels, int64_t m, int64_t k, int64_t n, const float* bias,
                      float* y, int threads) {
  panel_linear<F32>(x, panels, m, k, n, bias, y, threads);
}

void panel_linear_bf16(const uint16_t* x, const uint16_t* panels, int64_t m, int64_t k, int64_t n,
                       const float* bias, uint16_t* y, int threads) {
  panel_linear<BF16>(x, panels, m, k, n, bias, y, threads);
}

// The quantized GEMM: the threads split the panels as panel_linear does (each panel's bytes read once
// per call), rows in blocks of ~1 MiB of x. int4's sums of x over each group are computed once here.
template <class O>
void quant_linear_as(const QuantArgs& a) {
  const int64_t groups = a.group > 0 ? a.k / a.group : 0, count = (a.n + NR - 1) / NR;
  std::vector<float> xsum(a.m * groups);
  for (int64_t r = 0; r < a.m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * a.group; i < (g + 1) * a.group; ++i) s += a.x[r * a.k + i];
      xsum[r * groups + g] = s;
    }
  const int64_t block = std::max<int64_t>(24, (1 << 20) / (a.k * 4) / 24 * 24);
  parallel_ranges(count, a.threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < a.m; r += block)
      for (int64_t p = begin; p < end; ++p) {
        alignas(64) float b[NR] = {0};
        if (a.bias != nullptr) std::copy(a.bias + p * NR, a.bias + std::min(a.n, (p + 1) * NR), b);
        quant_panel_rows<O>(a, xsum.data(), r, std::min(block, a.m - r), p, b);
      }
  });
}

void quant_linear(const QuantArgs& a) {
  if (a.x_bf16 != nullptr)
    quant_linear_as<uint16_t>(a);
  else
    quant_linear_as<float>(a);
}

// Items differ in cost (a prefill's later tokens see more keys): the threads take them one at a time
// (dynamic), where a split into ranges would hand each thread a fixed share.
template <typename T>
void attention_items(const AttentionArgs& a) {
  const int64_t items = a.nchunks * a.kv_heads;
  const int threads = omp_in_parallel() ? 1 : static_cast<int>(std::clamp<int64_t>(items, 1, a.threads));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t* chunk = a.chunks + 2 * (item / a.kv_heads);
    run_item<T>(a, chunk[0], chunk[1], item % a.kv_heads, a.scratch + omp_get_thread_num() * a.per_thread);
  }
}

void paged_attention(Elem elem, const AttentionArgs& a) {
  switch (elem) {
    case Elem::F32: attention_items<float>(a); break;
    case Elem::F64: attention_items<double>(a); break;
    case Elem::BF16: attention_items<Bf16>(a); break;
    case Elem::F16: attention_items<F16>(a); break;
  }
}

void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out, int threads) {
  parallel_ranges(rows, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(x + r * n, n);
  });
}

}  // namespace
}  // namespace runner_kernels::RW_TIER

const runner_kernels::KernelTable& runner_kernels::RW_TABLE() {
  namespace t = runner_kernels::RW_TIER;
#if defined(__AVX512BF16__)
  constexpr bool native_bf16 = true;
#else
  constexpr bool native_bf16 = false;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  constexpr bool blas_f32 = false;
#else
  constexpr bool blas_f32 = true;
#endif
  static const KernelTable table{RW_TIER_NAME, native_bf16, blas_f32, &t::panel_linear_f32, &t::panel_linear_bf16,
                                 &t::paged_attention, &t::argmax_rows, &t::quant_linear};
  return table;
}
