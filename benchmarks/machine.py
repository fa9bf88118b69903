"""This machine's limits, measured in the same run as the engines, and the workload's work in FLOPs.

  matmul_peak(dtype)   GFLOP/s of the fastest matmul code here at the benchmark's thread count:
                       torch.mm, or runner_core's panel GEMM where it is faster (on AMD CPUs MKL
                       takes its AVX2 path: a limit set by torch.mm alone would be beaten), the
                       best over square and tall shapes (64-2048) of the fastest of several calls
  read_bandwidth()     GB/s of reading a 512 MiB buffer once (torch.sum; fastest of several)
  workload_flops(...)  the useful work of a workload on a model shape: every prompt and output
                       token through every layer's linears (2 x parameters), causal attention over
                       its context (QK^T and PV), and the LM head once per output token
  decode_weight_bytes  the bytes one decode step reads from the weights (all but the input
                       embedding table, of which it reads one row per token)
"""

from __future__ import annotations

import functools
import math
import time

import torch

from runner_core.config import dtype_bytes
from runner_core.memory.shapes import ModelShape

_PEAK_SHAPES = ((2048, 2048, 2048), (1024, 1024, 1024), (512, 2048, 2048), (256, 1376, 512), (64, 512, 512))


def _fastest(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(dtype: torch.dtype, calls: int = 5) -> float:
    """GFLOP/s: the best rate of torch.mm, and of the panel GEMM where it applies, over a few shapes
    (m x k @ k x n)."""
    from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear, panels_support

    panels = cpu_kernels_available() and panels_support(dtype)
    best = 0.0
    for m, k, n in _PEAK_SHAPES:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        candidates = [functools.partial(torch.mm, a, b)]
        if panels:
            candidates.append(functools.partial(panel_linear, a, pack_panels(b.t()), n, None))
        for fn in candidates:
            best = max(best, 2 * m * k * n / _fastest(fn, calls) / 1e9)
    return best


def read_bandwidth(mib: int = 512, calls: int = 5) -> float:
    """GB/s of one pass over `mib` MiB of float32 (a sum, so nothing is written)."""
    x = torch.ones(mib << 18)
    return x.numel() * 4 / _fastest(lambda: x.sum(), calls) / 1e9


def workload_flops(shape: ModelShape, requests: list[tuple[int, int]], attention: bool = True) -> float:
    """FLOPs of the useful work of (prompt_len, output_len) requests on a dense model (`attention`
    False: the matmuls with weights alone)."""
    # every layer's projection weights (the checkpoint's *_proj.weight tensors), two FLOPs per weight
    per_token = 2 * sum(math.prod(dims) for name, dims in shape.checkpoint_tensors()
                        if name.startswith("model.layers.") and name.endswith("_proj.weight"))
    attn = 4 * shape.num_layers * shape.num_heads * shape.head_dim  # per (query, key) pair: QK^T + PV
    head = 2 * shape.hidden_size * shape.vocab_size
    total = 0.0
    for prompt, out in requests:
        tokens = prompt + out - 1  # the last output token is sampled, never fed back
        pairs = tokens * (tokens + 1) / 2  # causal: position p attends to p + 1 keys
        total += tokens * per_token + (pairs * attn if attention else 0) + out * head
    return total


def decode_weight_bytes(shape: ModelShape, dtype: str) -> int:
    """Weight bytes one decode step reads: every tensor but the input embedding table (one row of
    it per token), which is read whole only when it is also the LM head."""
    return dtype_bytes(dtype) * sum(math.prod(dims) for name, dims in shape.checkpoint_tensors()
                                    if name != "model.embed_tokens.weight" or shape.tie_word_embeddings)
