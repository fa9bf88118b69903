// The torch ops of the native CPU kernels, built for the baseline ISA: argument checks, output
// allocation, weight packing, and the choice of one instruction-set tier's kernels (tier.h) from the
// CPU's features when the library loads (the highest tier it can run), changeable with set_cpu_tier.
// Registered as runner_kernels::{paged_attention, pack_panels, panel_linear, panels_support,
// pack_quantized, quant_linear, argmax_rows, cpu_tiers, cpu_tier, set_cpu_tier}.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tier.h"

namespace {

using runner_kernels::KernelTable;
using runner_kernels::NR;

// every tier this build has, lowest first, with whether this CPU runs it
std::vector<std::pair<const KernelTable*, bool>> all_tiers() {
  std::vector<std::pair<const KernelTable*, bool>> tiers{{&runner_kernels::table_plain(), true}};
#if defined(__x86_64__)
  // __builtin_cpu_supports also checks that the OS saves the AVX and AVX512 registers
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  tiers.emplace_back(&runner_kernels::table_avx2(), avx2);
  tiers.emplace_back(&runner_kernels::table_avx512(), avx512);
  tiers.emplace_back(&runner_kernels::table_avx512_bf16(), avx512 && __builtin_cpu_supports("avx512bf16"));
#endif
  return tiers;
}

const KernelTable* best_tier() {
  const KernelTable* best = nullptr;
  for (const auto& [table, runs] : all_tiers())
    if (runs) best = table;
  return best;
}

std::atomic<const KernelTable*> current{best_tier()};

const KernelTable& kernels() { return *current.load(std::memory_order_relaxed); }

std::vector<std::string> cpu_tiers() {
  std::vector<std::string> names;
  for (const auto& [table, runs] : all_tiers())
    if (runs) names.emplace_back(table->name);
  return names;
}

std::string cpu_tier() { return kernels().name; }

void set_cpu_tier(const std::string& name) {
  std::string known;
  for (const auto& [table, runs] : all_tiers()) {
    if (name == table->name) {
      TORCH_CHECK(runs, "set_cpu_tier: this CPU cannot run the ", name, " kernels; it runs ",
                  c10::Join(", ", cpu_tiers()));
      current.store(table);
      return;
    }
    known += (known.empty() ? "" : ", ") + std::string(table->name);
  }
  TORCH_CHECK(false, "set_cpu_tier: no tier named '", name, "'; this build has ", known);
}

// every tier multiplies float32 and bfloat16 panels (bfloat16 natively or widened in registers)
bool panels_support(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

// k values per panel step: 1 (float32) or 2 (bfloat16)
int64_t k_per_step(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// A panel's steps in order, each step's NR columns x KPS values written side by side (the output is written
// front to back, one cache line after another, and reads 16 rows at once); KPS a constant, so no division
template <class E, int KPS>
void pack(const E* src, E* dst, int64_t n, int64_t k, int64_t panels) {
  const int64_t steps = (k + KPS - 1) / KPS, full = k / KPS, stride = steps * NR * KPS;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const E* rows[NR];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(NR, n - p * NR);
      for (int64_t c = 0; c < cols; ++c) rows[c] = src + (p * NR + c) * k;
      E* out = dst + p * stride;
      for (int64_t s = 0; s < full; ++s, out += NR * KPS)
        for (int64_t c = 0; c < cols; ++c)
          std::memcpy(out + c * KPS, rows[c] + s * KPS, sizeof(E) * KPS);  // one move: a k pair of bfloat16
      if (full < steps)  // k's last, partial step (the rest of the step stays zero)
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t j = 0; j < k - full * KPS; ++j) out[c * KPS + j] = rows[c][full * KPS + j];
    }
  });
}

// A zero-filled tensor on pages of its own (mmap): freed with the model they go straight back to the
// system. From malloc they would raise glibc's mmap threshold and the next model's tensors would stay in
// the heap after an unload (tests/test_unload_memory.py)
at::Tensor mapped(at::IntArrayRef shape, const at::TensorOptions& options, const char* op) {
  size_t bytes = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  for (const int64_t d : shape) bytes *= static_cast<size_t>(d);
  bytes = std::max<size_t>(1, bytes);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  TORCH_CHECK(mem != MAP_FAILED, op, ": cannot map ", bytes, " bytes");
  return at::from_blob(mem, shape, [bytes](void* p) { munmap(p, bytes); }, options);
}

// weight [n, k] -> [ceil(n / 16), k, 16] (float32) or [ceil(n / 16), ceil(k / 2), 32] (bfloat16)
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: a [n, k] weight");
  TORCH_CHECK(panels_support(weight.scalar_type()), "pack_panels: no panel kernel for ", weight.scalar_type(),
              " (float32 and bfloat16 only)");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR, kps = k_per_step(w.scalar_type());
  const int64_t steps = (k + kps - 1) / kps;
  auto out = mapped({panels, steps, NR * kps}, w.options(), "pack_panels");
  if (kps == 1)
    pack<float, 1>(w.data_ptr<float>(), out.data_ptr<float>(), n, k, panels);
  else
    pack<uint16_t, 2>(reinterpret_cast<const uint16_t*>(w.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                      n, k, panels);
  return out;
}

// x: [m, k] in the panels' dtype; panels: pack_panels of an [n, k] weight; bias: [n] or none -> [m, n]
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias) {
  const auto dtype = panels.scalar_type();
  const int64_t kps = k_per_step(dtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && panels_support(dtype),
              "panel_linear: x must be a [rows, k] matrix in the panels' dtype (float32 or bfloat16)");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR * kps && panels.size(1) == (x.size(1) + kps - 1) / kps &&
                  panels.is_contiguous() && (n + NR - 1) / NR == panels.size(0),
              "panel_linear: panels must be pack_panels of an [n, k] weight with k = x.size(1)");
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == dtype, "panel_linear: bias must be [n] in x's dtype");
  if (dtype == at::kFloat && kernels().blas_f32) {
    // every panel at once through BLAS: [panels, m, k] x [panels, k, 16] -> [m, panels * 16], cut at n
    const auto xc = x.contiguous();
    auto y = at::bmm(xc.unsqueeze(0).expand({panels.size(0), xc.size(0), xc.size(1)}), panels)
                 .permute({1, 0, 2}).reshape({xc.size(0), panels.size(0) * NR}).narrow(1, 0, n);
    return bias.has_value() ? y.add(*bias) : y.contiguous();
  }
  at::Tensor b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  auto xc = x.contiguous();
  if (xc.size(1) % kps != 0) xc = at::constant_pad_nd(xc, {0, kps - xc.size(1) % kps});  // whole k pairs
  auto out = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) == 0) return out;
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  const int threads = at::get_num_threads();
  if (dtype == at::kBFloat16)
    kernels().panel_linear_bf16(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
                                reinterpret_cast<const uint16_t*>(panels.data_ptr()), xc.size(0), xc.size(1), n,
                                bias_ptr, reinterpret_cast<uint16_t*>(out.data_ptr()), threads);
  else
    kernels().panel_linear_f32(xc.data_ptr<float>(), panels.data_ptr<float>(), xc.size(0), xc.size(1), n, bias_ptr,
                               out.data_ptr<float>(), threads);
  return out;
}

// quantize()'s row-major tensors -> the quantized kernel's panels (group 0: int8, else int4 groups):
// int8: qweight int8 [n, k], scales [n, 1] -> int8 [P, k, 16], float32 [P, 1, 16];
// int4: qweight uint8 [n, k / 2] (low nibble: even k), scales and mins [n, k / group] -> uint8
// [P, k / 2, 16] (a byte holds a column's k pair), float32 [P, k / group, 16] twice; P = ceil(n / 16)
std::vector<at::Tensor> pack_quantized(const at::Tensor& qweight, const at::Tensor& scales,
                                       const c10::optional<at::Tensor>& mins, int64_t group) {
  const bool int4 = group > 0;
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == (int4 ? at::kByte : at::kChar),
              "pack_quantized: qweight must be a 2-D ", int4 ? "uint8 [n, k / 2] (int4)" : "int8 [n, k] (int8)",
              " tensor, got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0), k = qweight.size(1) * (int4 ? 2 : 1), panels = (n + NR - 1) / NR;
  TORCH_CHECK(!int4 || k % group == 0, "pack_quantized: k=", k, " is not a multiple of the int4 group size ", group);
  const int64_t groups = int4 ? k / group : 1;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == groups,
              "pack_quantized: scales must be float32 [n, ", int4 ? "k / group" : "1", "] = [", n, ", ", groups,
              "], got ", scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(int4 == mins.has_value(), "pack_quantized: int4 takes mins (int8 none)");
  if (int4)
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes(),
                "pack_quantized: mins must be float32 [n, k / group] like scales, got ", mins->scalar_type(), " ",
                mins->sizes());
  const auto q = qweight.contiguous();
  auto qp = mapped({panels, q.size(1), NR}, q.options(), "pack_quantized");
  if (int4)
    pack<uint8_t, 1>(q.data_ptr<uint8_t>(), qp.data_ptr<uint8_t>(), n, q.size(1), panels);
  else
    pack<int8_t, 1>(q.data_ptr<int8_t>(), qp.data_ptr<int8_t>(), n, k, panels);
  std::vector<at::Tensor> out{qp};
  for (const auto& t : int4 ? std::vector<at::Tensor>{scales, *mins} : std::vector<at::Tensor>{scales}) {
    const auto src = t.contiguous();
    auto dst = mapped({panels, groups, NR}, src.options(), "pack_quantized");
    pack<float, 1>(src.data_ptr<float>(), dst.data_ptr<float>(), n, groups, panels);
    out.push_back(dst);
  }
  return out;
}

// x: [m, k] float32 or bfloat16; qpanels, scales, mins: pack_quantized of an [n, k] weight (group 0:
// int8); bias: [n] or none -> [m, n] in x's dtype
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qpanels, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t n, int64_t group,
                        const c10::optional<at::Tensor>& bias) {
  const bool int4 = group > 0;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be a float32 or bfloat16 [rows, k] matrix, got ", x.scalar_type(), " ", x.sizes());
  const int64_t k = x.size(1), panels = (n + NR - 1) / NR;
  TORCH_CHECK(!int4 || (group % 2 == 0 && k % group == 0), "quant_linear: k=", k,
              " is not a multiple of the int4 group size ", group);
  const int64_t groups = int4 ? k / group : 1;
  TORCH_CHECK(qpanels.dim() == 3 && qpanels.is_contiguous() && qpanels.scalar_type() == (int4 ? at::kByte : at::kChar) &&
                  qpanels.size(0) == panels && qpanels.size(1) == (int4 ? k / 2 : k) && qpanels.size(2) == NR,
              "quant_linear: the packed weight must be pack_quantized of an [n, k] = [", n, ", ", k, "] ",
              int4 ? "int4" : "int8", " weight, got ", qpanels.scalar_type(), " ", qpanels.sizes());
  for (const auto* t : {&scales, mins.has_value() ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == panels &&
                    t->size(1) == groups && t->size(2) == NR,
                "quant_linear: scales and mins must be pack_quantized's float32 [", panels, ", ", groups, ", 16], got ",
                t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(int4 == mins.has_value(), "quant_linear: int4 takes mins (int8 none)");
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(), "quant_linear: bias must be [n] = [", n,
                "] in x's dtype, got ", bias->scalar_type(), " ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto xb = x.contiguous(), xf = xb.to(at::kFloat);  // bfloat16 widened once per call
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return out;
  const runner_kernels::QuantArgs args{xf.data_ptr<float>(),
                                       bf16 ? reinterpret_cast<const uint16_t*>(xb.data_ptr()) : nullptr,
                                       qpanels.data_ptr(),
                                       scales.data_ptr<float>(),
                                       int4 ? mins->data_ptr<float>() : nullptr,
                                       b.defined() ? b.data_ptr<float>() : nullptr,
                                       out.data_ptr(),
                                       x.size(0), k, n, group, at::get_num_threads()};
  kernels().quant_linear(args);
  return out;
}

runner_kernels::Elem elem_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return runner_kernels::Elem::F32;
    case at::kDouble: return runner_kernels::Elem::F64;
    case at::kBFloat16: return runner_kernels::Elem::BF16;
    case at::kHalf: return runner_kernels::Elem::F16;
    default: TORCH_CHECK(false, "paged_attention: no kernel for ", dtype, " (float32, float64, bfloat16, float16)");
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "q, out and the caches must have one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  row_seq.scalar_type() == at::kLong,
              "block_tables, row_seq and context_lens must be int64");
  TORCH_CHECK(row_seq.numel() == q.size(0) && context_lens.numel() == q.size(0),
              "row_seq and context_lens need one entry per query row");
  const auto elem = elem_of(q.scalar_type());
  const auto bt = block_tables.contiguous(), rs = row_seq.contiguous(), cl = context_lens.contiguous();
  const int64_t* seq = rs.data_ptr<int64_t>();
  const int64_t* lens = cl.data_ptr<int64_t>();
  // work items: (first row, tokens) chunks of runs of one sequence, times the KV heads
  std::vector<int64_t> chunks;
  int64_t most = 0, max_len = 0;
  for (int64_t r = 0, n = q.size(0); r < n;) {
    int64_t e = r + 1;
    while (e < n && e - r < runner_kernels::RUN_TOKENS && seq[e] == seq[r]) ++e;
    chunks.push_back(r);
    chunks.push_back(e - r);
    most = std::max(most, e - r);
    for (int64_t i = r; i < e; ++i) max_len = std::max(max_len, lens[i]);
    r = e;
  }
  const int64_t heads = q.size(1), kv_heads = k_cache.size(0), dim = q.size(2);
  const int64_t keys = sliding_window > 0 ? std::min(max_len, sliding_window + runner_kernels::RUN_TOKENS) : max_len;
  const int64_t per_thread = runner_kernels::attention_scratch_floats(dim, most * (heads / kv_heads), keys);
  const int threads = at::get_num_threads();
  // allocated here: a buffer allocated inside a worker thread lands in that thread's own malloc
  // arena, which keeps its pages after the model is unloaded
  std::vector<float> scratch(threads * per_thread);
  const runner_kernels::AttentionArgs args{
      out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr<int64_t>(), seq, lens,
      chunks.data(), static_cast<int64_t>(chunks.size() / 2), heads, kv_heads, dim, k_cache.size(1), bt.size(1),
      block_size, sliding_window, static_cast<float>(scale), scratch.data(), per_thread, threads};
  kernels().paged_attention(elem, args);
}

// logits: [rows, vocab] float32 -> [rows] int64
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits must be a float32 [rows, vocab] matrix with vocab > 0");
  const auto x = logits.contiguous();
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  kernels().argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>(), at::get_num_threads());
  return out;
}

}  // namespace

TORCH_LIBRARY(runner_kernels, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor row_seq, Tensor context_lens, int block_size, float scale, int sliding_window) -> ()");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("panels_support(ScalarType dtype) -> bool", &panels_support);
  m.def("pack_quantized(Tensor qweight, Tensor scales, Tensor? mins, int group) -> Tensor[]");
  m.def("quant_linear(Tensor x, Tensor qpanels, Tensor scales, Tensor? mins, int n, int group, Tensor? bias) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("cpu_tiers() -> str[]", &cpu_tiers);
  m.def("cpu_tier() -> str", &cpu_tier);
  m.def("set_cpu_tier(str name) -> ()", &set_cpu_tier);
}

TORCH_LIBRARY_IMPL(runner_kernels, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
  m.impl("pack_quantized", &pack_quantized);
  m.impl("quant_linear", &quant_linear);
  m.impl("argmax_rows", &argmax_rows);
}
