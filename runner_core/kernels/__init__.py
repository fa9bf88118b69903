"""Native kernels, built on first use with torch's C++ extension tooling and cached (build.py).

`native_paged_attention()` is attention for any mix of decode and prefill tokens, reading
keys and values in place from the KV pool through block tables (no gathered copy);
`panel_linear()` is x W^T + b in float32 or bfloat16 (float32 accumulation) over weights prepacked
by `pack_panels()` into panels of 16 output columns (a register-tiled GEMM on AVX2 and AVX512, 1.1-5x
BLAS at decode batch sizes; on the plain tier float32 panels go to BLAS's batched GEMM, which beats
compiler-vectorised C++ there; docs/benchmarks.md); `argmax_rows()` is greedy sampling's argmax
(torch's is 10x slower). `pack_quantized()` and `quant_linear()` multiply int8 and int4 weights,
dequantized in registers (runner_core/layers/quantization.py is their Python side). Callers go through
these wrappers, never `torch.ops.runner_kernels` directly.

The kernels are built once per instruction-set tier (`TIERS`: plain C++, AVX2+FMA, AVX512,
AVX512-BF16) into one library, which runs the highest tier this CPU can execute; bfloat16 is
multiplied natively on AVX512-BF16 and widened to float32 in registers on every other tier.
RUNNER_CORE_CPU_TIER=<tier> forces a tier (one this CPU runs), `set_kernel_tier()` changes it at run
time. The kernels run on torch's OpenMP threads (`torch.set_num_threads`). If the build fails, or
RUNNER_CORE_NO_KERNELS=1 is set, callers get None and keep the pure-torch path; the reason is
logged once. Under CI=true a failed build is an error, so a broken toolchain cannot hide behind
the fallback. A build (once per machine and torch version) shows a progress bar with its elapsed
time (runner_core/progress.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from runner_core.errors import ConfigError
from runner_core.kernels import build
from runner_core.progress import progress, ticking

logger = logging.getLogger("runner_core")
TIERS = ("plain", "avx2", "avx512", "avx512-bf16")  # every tier there is, lowest first
PANEL_COLUMNS = 16  # output columns per panel (NR in tier.h)
_lock = threading.Lock()
_state: dict[str, object] = {}


def _build() -> None:
    """Build (with a progress bar when not cached) and load the library into torch.ops.runner_kernels."""
    built = build.is_built()
    with progress(desc="Building the native CPU kernels, every tier (first use; cached afterwards)", total=1,
                  unit="build", leave=True) if not built else nullcontext() as bar, ticking(bar):
        build.build()
        if bar is not None:
            bar.update(1)


def _load() -> None:
    if not hasattr(torch.ops.runner_kernels, "panel_linear"):
        _build()
    forced = os.environ.get("RUNNER_CORE_CPU_TIER")
    if forced:
        _set_tier(forced, f"RUNNER_CORE_CPU_TIER={forced}")
    else:
        _state["why"] = "the highest tier this CPU runs"
    logger.info("native CPU kernels: tier %s (%s; this CPU runs %s)", torch.ops.runner_kernels.cpu_tier(),
                _state["why"], ", ".join(torch.ops.runner_kernels.cpu_tiers()))


def _set_tier(name: str, why: str) -> None:
    runnable = tuple(torch.ops.runner_kernels.cpu_tiers())
    if name not in runnable:
        what = "is not a kernel tier" if name not in TIERS else "is a tier this CPU cannot run"
        raise ConfigError(f"{why}: {name!r} {what}; this CPU runs {', '.join(runnable)} (tiers: {', '.join(TIERS)})."
                          " Pick one of those, or unset it for the highest")
    torch.ops.runner_kernels.set_cpu_tier(name)
    _state["why"] = why


def _register_fakes() -> None:
    """Output shapes for tracing, so compiled graphs (and fake-tensor tracing) call the kernels as
    opaque ops. (paged_attention returns nothing: it writes `out`, which its schema declares.)"""
    @torch.library.register_fake("runner_kernels::panel_linear")
    def _(x, panels, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("runner_kernels::pack_panels")
    def _(weight):
        return weight.new_empty(panels_shape(*weight.shape, weight.dtype))

    @torch.library.register_fake("runner_kernels::pack_quantized")
    def _(qweight, scales, mins, group):
        panels, width = -(-qweight.shape[0] // PANEL_COLUMNS), qweight.shape[1]
        parts = [qweight.new_empty(panels, width, PANEL_COLUMNS)]
        for t in (scales,) if mins is None else (scales, mins):
            parts.append(t.new_empty(panels, t.shape[1], PANEL_COLUMNS))
        return parts

    @torch.library.register_fake("runner_kernels::quant_linear")
    def _(x, qpanels, scales, mins, n, group, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("runner_kernels::argmax_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)


def cpu_kernels_available() -> bool:
    """Build (once per process; cached on disk across processes) and report whether the CPU kernels load."""
    with _lock:
        if "ok" not in _state:
            if os.environ.get("RUNNER_CORE_NO_KERNELS") == "1":
                _state["ok"], _state["why"] = False, "RUNNER_CORE_NO_KERNELS=1"
            else:
                try:
                    _load()
                    _register_fakes()
                    _state["ok"] = True
                except ConfigError:
                    raise
                except Exception as e:  # compiler missing, build error
                    if os.environ.get("CI") == "true":
                        raise
                    _state["ok"], _state["why"] = False, f"{type(e).__name__}: {e}"
            if not _state["ok"]:
                logger.warning("native CPU kernels unavailable (%s); using the torch paths",
                               _state["why"])
        return bool(_state["ok"])


def kernel_tiers() -> tuple[str, ...]:
    """The tiers this CPU runs, lowest first; empty when the kernels are off."""
    return tuple(torch.ops.runner_kernels.cpu_tiers()) if cpu_kernels_available() else ()


def kernel_tier() -> str:
    """The tier the kernels run now ("plain", "avx2", "avx512", "avx512-bf16"), or "off"."""
    return str(torch.ops.runner_kernels.cpu_tier()) if cpu_kernels_available() else "off"


def kernel_info() -> dict:
    """The tier, why it was chosen, and the tiers this CPU runs (for model_info and the dashboards)."""
    tier = kernel_tier()
    return {"tier": tier, "why": str(_state.get("why", "")), "runnable": list(kernel_tiers()),
            "native_bf16": tier == "avx512-bf16"}


def set_kernel_tier(name: str) -> None:
    """Run the kernels of tier `name` from now on (one of `kernel_tiers()`); it takes effect at the next op."""
    if not cpu_kernels_available():
        raise ConfigError(f"set_kernel_tier({name!r}): the native kernels are off ({_state['why']})")
    with _lock:
        _set_tier(name, f"set_kernel_tier({name!r})")


@contextmanager
def use_kernel_tier(name: str) -> Iterator[None]:
    """The kernels of tier `name` inside the block, the previous tier after it."""
    before, why = kernel_tier(), _state.get("why")
    set_kernel_tier(name)
    try:
        yield
    finally:
        torch.ops.runner_kernels.set_cpu_tier(before)
        _state["why"] = why


def native_paged_attention(out, q, k_cache, v_cache, block_tables, row_seq, context_lens, block_size: int,
                           scale: float, sliding_window: int | None) -> None:
    """out[i] = attention of query row q[i] ([rows, heads, dim]) over keys 0..context_lens[i]-1 of the
    sequence whose block table is block_tables[row_seq[i]], read in place from the pool."""
    torch.ops.runner_kernels.paged_attention(out, q, k_cache, v_cache, block_tables, row_seq, context_lens,
                                           block_size, scale, sliding_window or 0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of a float32 [rows, vocab] CPU matrix, at memory speed."""
    return torch.ops.runner_kernels.argmax_rows(logits)


def panels_support(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply panels of `dtype`: float32 and bfloat16, on every tier."""
    return torch.ops.runner_kernels.panels_support(dtype)


def panels_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The shape `pack_panels` gives an [n, k] weight: [ceil(n / 16), k, 16] in float32,
    [ceil(n / 16), ceil(k / 2), 32] in bfloat16 (k in pairs: values per panel step, tier.h)."""
    per_step = 2 if dtype == torch.bfloat16 else 1
    return -(-n // PANEL_COLUMNS), -(-k // per_step), PANEL_COLUMNS * per_step


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """An [n, k] weight as panels of 16 output columns (zero padded), what `panel_linear` reads
    (`panels_shape`)."""
    return torch.ops.runner_kernels.pack_panels(weight)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W^T + bias -> [m, n], W given as `pack_panels(W)`."""
    return torch.ops.runner_kernels.panel_linear(x, panels, n, bias)


def pack_quantized(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   group: int) -> list[torch.Tensor]:
    """Row-major int8 [n, k] or int4 [n, k / 2] weights with their float32 scales (and int4's minimums) as
    [qpanels, scales(, mins)] in panels of 16 output columns, what `quant_linear` reads
    (runner_core/layers/quantization.py says the layout)."""
    return torch.ops.runner_kernels.pack_quantized(qweight, scales, mins, group)


def quant_linear(x: torch.Tensor, qpanels: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int,
                 group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] (float32 or bfloat16) @ W^T + bias -> [m, n] in x's dtype, W given as `pack_quantized`'s
    tensors (group 0: int8), dequantized in registers."""
    return torch.ops.runner_kernels.quant_linear(x, qpanels, scales, mins, n, group, bias)
