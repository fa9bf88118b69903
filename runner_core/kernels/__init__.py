"""Native kernels, built on first use with torch's C++ extension tooling and cached.

`native_paged_attention()` is attention for any mix of decode and prefill tokens, reading
keys and values in place from the KV pool through block tables (no gathered copy);
`panel_linear()` is x W^T + b in float32 (or bfloat16 on AVX512-BF16 CPUs, float32 accumulation)
over weights prepacked by `pack_panels()` into panels of 16 output columns (a register-tiled GEMM:
BLAS on these CPUs runs the decode batch sizes at a third of its speed, see docs/benchmarks.md,
"Native kernels"); `argmax_rows()` is greedy sampling's argmax (torch's is 10x slower).
The kernels run on torch's OpenMP threads (`torch.set_num_threads`). If the build fails, or
RUNNER_CORE_NO_KERNELS=1 is set, callers get None and keep the pure-torch path; the reason is
logged once. Under CI=true a failed build is an error, so a broken toolchain cannot hide behind
the fallback. A build (~10 s, once per machine) shows a progress bar with its elapsed time (runner_core/progress.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from contextlib import nullcontext
from pathlib import Path

import torch

from runner_core.config import cache_root
from runner_core.progress import progress, ticking

logger = logging.getLogger("runner_core")
_NAME = "runner_core_cpu_kernels"
_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("paged_attention_cpu.cpp", "panel_linear_cpu.cpp", "argmax_cpu.cpp"))
_HEADERS = (Path(__file__).with_name("panel_tile.h"),)  # included by the sources
PANEL_COLUMNS = 16  # output columns per panel (NR in panel_tile.h)
_lock = threading.Lock()
_state: dict[str, object] = {}


def _build_dir() -> Path:
    # -march=native: the build is only valid for this CPU, so its flags are part of the key
    cpu = platform.machine() + "".join(line for line in _cpuinfo().splitlines() if line.startswith("flags"))[:4096]
    code = b"".join(source.read_bytes() for source in _SOURCES + _HEADERS)
    tag = hashlib.sha256(code + torch.__version__.encode() + cpu.encode()).hexdigest()[:12]
    path = cache_root() / "kernels" / f"cpu_kernels-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor()


def _ensure_ninja_on_path() -> None:
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _load() -> bool:
    if hasattr(torch.ops.runner_kernels, "panel_linear"):
        return True
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    build_dir = _build_dir()
    # build from a copy inside the (content-keyed) build folder: the compile command then does not
    # depend on where this package lives, so checkouts sharing a cache do not rebuild each other
    for original in _SOURCES + _HEADERS:
        source = build_dir / original.name
        if not source.exists() or source.read_bytes() != original.read_bytes():
            tmp = build_dir / f".{original.name}.{os.getpid()}"
            tmp.write_bytes(original.read_bytes())
            os.replace(tmp, source)
    sources = [str(build_dir / original.name) for original in _SOURCES]
    built = (build_dir / f"{_NAME}.so").exists()  # then the call below only loads it
    with progress(desc="Building the native CPU kernels (first use; cached afterwards)", total=1, unit="build",
                  leave=True) if not built else nullcontext() as bar, ticking(bar):
        # -fopenmp: without it ATen's parallel_for compiles to a serial loop; its OpenMP calls bind to
        # the libgomp torch loaded, so the kernels share torch's thread pool and thread count
        cpp_extension.load(
            name=_NAME, sources=sources, build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=False, verbose=False)
        if bar is not None:
            bar.update(1)
    return True


def _register_fakes() -> None:
    """Output shapes for tracing, so compiled graphs (and fake-tensor tracing) call the kernels as
    opaque ops. (paged_attention returns nothing: it writes `out`, which its schema declares.)"""
    @torch.library.register_fake("runner_kernels::panel_linear")
    def _(x, panels, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("runner_kernels::pack_panels")
    def _(weight):
        per_step = 2 if weight.dtype == torch.bfloat16 else 1  # k values per panel row (panel_linear_cpu.cpp)
        n, k = weight.shape
        return weight.new_empty(-(-n // PANEL_COLUMNS), -(-k // per_step), PANEL_COLUMNS * per_step)

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
                    _state["ok"] = _load()
                    _register_fakes()
                except Exception as e:  # compiler missing, build error
                    if os.environ.get("CI") == "true":
                        raise
                    _state["ok"], _state["why"] = False, f"{type(e).__name__}: {e}"
            if not _state["ok"]:
                logger.warning("native CPU kernels unavailable (%s); using the torch paths",
                               _state["why"])
        return bool(_state["ok"])


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
    """Whether this build multiplies panels of `dtype`: float32 always, bfloat16 with AVX512-BF16."""
    return torch.ops.runner_kernels.panels_support(dtype)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """An [n, k] weight as panels of 16 output columns (zero padded), what `panel_linear` reads:
    [ceil(n / 16), k, 16] in float32, [ceil(n / 16), ceil(k / 2), 32] in bfloat16 (k in pairs)."""
    return torch.ops.runner_kernels.pack_panels(weight)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W^T + bias -> [m, n], W given as `pack_panels(W)`."""
    return torch.ops.runner_kernels.panel_linear(x, panels, n, bias)
