// The interface between the dispatcher (dispatch.cpp: built for the baseline ISA, registers the torch
// ops, checks arguments, allocates) and the kernels of one instruction-set tier (tier.cpp, compiled
// once per tier with that tier's flags, into its own namespace). Plain pointers and sizes only: no
// torch header is compiled for a tier, so no inline torch function built with a higher tier's
// instructions can take the place of the baseline's copy at link time.
#pragma once

#include <cstdint>

namespace runner_kernels {

constexpr int64_t NR = 16;          // output columns per panel
constexpr int64_t RUN_TOKENS = 32;  // tokens of one sequence's run per attention work item

// the element types attention reads (the pool's dtype); bfloat16 and float16 are raw 16-bit values
enum class Elem : int { F32, F64, BF16, F16 };

struct AttentionArgs {
  void* out;           // [rows, heads, dim]
  const void* q;       // [rows, heads, dim]
  const void* k;       // [kv_heads, slots, dim]
  const void* v;       // [kv_heads, slots, dim]
  const int64_t* tables;  // [seqs, max_blocks]
  const int64_t* row_seq;  // [rows]: the row's block table
  const int64_t* lens;     // [rows]: the row attends to keys [len - window, len)
  const int64_t* chunks;   // [nchunks, 2]: (first row, tokens) of a run of one sequence
  int64_t nchunks, heads, kv_heads, dim, slots, max_blocks, block_size, window;
  float scale;
  float* scratch;  // threads x per_thread floats
  int64_t per_thread;
  int threads;
};

// y[m, n] = x[m, k] W^T + bias, W stored quantized in panels of 16 columns (dispatch.cpp's
// pack_quantized): int8 (group 0) [P, k, 16] with scales [P, 1, 16]; int4 [P, k / 2, 16] (a byte holds a
// column's k pair, low nibble the even k) with scales and mins [P, k / group, 16]; P = ceil(n / 16)
struct QuantArgs {
  const float* x;       // [m, k]
  const uint16_t* x_bf16;  // the same x in bfloat16 when the caller's x was (else null)
  const void* qpanels;  // int8_t (int8) or uint8_t (int4)
  const float* scales;
  const float* mins;    // int4 only
  const float* bias;    // n floats or null
  void* y;              // [m, n]: bfloat16 (raw 16 bits) when x_bf16 is given, else float32
  int64_t m, k, n, group;  // group 0: int8
  int threads;
};

struct KernelTable {
  const char* name;
  bool native_bf16;  // bfloat16 products in hardware; otherwise widened to float32 in registers
  // float32 panels go to ATen's batched GEMM (BLAS) instead of panel_linear_f32: the plain tier, whose
  // compiler-vectorised loop BLAS beats 1.3-4x at every row count (docs/benchmarks.md, "Native kernels")
  bool blas_f32;
  // y[m, n] = x[m, k] W^T + bias over pack_panels(W): [ceil(n / 16), k, 16] float32 or
  // [ceil(n / 16), ceil(k / 2), 32] bfloat16 (k even for bfloat16); bias: n floats or null
  void (*panel_linear_f32)(const float* x, const float* panels, int64_t m, int64_t k, int64_t n, const float* bias,
                           float* y, int threads);
  void (*panel_linear_bf16)(const uint16_t* x, const uint16_t* panels, int64_t m, int64_t k, int64_t n,
                            const float* bias, uint16_t* y, int threads);
  void (*paged_attention)(Elem elem, const AttentionArgs& args);
  void (*argmax_rows)(const float* x, int64_t rows, int64_t n, int64_t* out, int threads);
  void (*quant_linear)(const QuantArgs& args);
};

// one table per tier, lowest first; x86-64 builds all four, other CPUs the plain one
const KernelTable& table_plain();
#if defined(__x86_64__)
const KernelTable& table_avx2();
const KernelTable& table_avx512();
const KernelTable& table_avx512_bf16();
#endif

// floats of scratch one attention work item of `rows` query rows over up to `keys` keys needs
inline int64_t attention_scratch_floats(int64_t dim, int64_t rows, int64_t keys) {
  const int64_t kp = (keys + NR - 1) / NR * NR, dp = (dim + NR - 1) / NR * NR;
  return rows * dim + rows * kp + kp * dim + dp * kp + rows * dp;
}

}  // namespace runner_kernels
