"""DecodePrograms: static-shape programs for pure-decode steps of chosen batch sizes (vLLM's
compile sizes and CUDA-graph capture sizes), and the padding that routes a decode batch to one.

* CPU (`PackedDecodePrograms`, AOTInductor route): one package per size, exported for exactly that
  many tokens with every linear layer on MKL's packed GEMM. Both eager and the general compiled
  program call the same BLAS for the matmuls (~83% of an eager batch-1 forward of small-llama), so
  the packed GEMM is where a small decode batch gains. Inductor's own `freezing` uses it only
  outside AOTInductor (the packed buffer holds address-dependent metadata and cannot be stored), so
  the runner packs the weights itself at load and passes them as program inputs: the warm start
  stays a package load. Costs memory: MKL's packed copies are 2.2-5.6x the linear weights on
  small-llama's shapes and far more on tiny ones (a large minimum buffer), reported as
  `memory_bytes`; they are not built when they would take over half the available memory.
* CUDA (`CUDAGraphDecodePrograms`): each size captured as a CUDA graph over the model as it is
  (eager or compiled without inductor's own graphs) on static input and metadata tensors; a replay
  copies the step's inputs and metadata into them. Graph memory is measured and reported.

Padding: a decode batch of D sequences runs at the smallest size S >= D; the S - D pad rows repeat
the first row (token, position, slot, block table), so they write the values that row writes to the
slot it writes and read what it reads; their outputs are dropped. No slot is reserved for them.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from runner_core.compile.aoti_program import AOTICall, AOTIProgram
from runner_core.compile.compile_optimizer import CUDA_GRAPH_MODES, WARM_START_ENV, CompileSettings
from runner_core.layers.attention import set_forward_context
from runner_core.layers.linear import LinearBase, pack_linear_weights, unpack_linear_weights

logger = logging.getLogger("runner_core")

MIN_GAIN = 0.9  # the default CPU decode program is kept when it takes at most 90% of the general program's time
GRAPH_MEMORY_FRACTION = 0.1  # decode CUDA graphs may hold at most this share of the device's memory


def default_sizes(device_type: str, max_num_seqs: int) -> list[int]:
    """CPU: [1], kept only where it measures faster (`pays_off`; at 8 and 32 tokens the packed
    GEMM is no faster than the plain one). CUDA: 1, 2, 4, 8 and multiples of 16 up to max_num_seqs."""
    if device_type != "cuda":
        return [1]
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return [s for s in sizes if s <= max_num_seqs] or [1]


@functools.lru_cache(maxsize=None)
def _packed_size(shape: tuple[int, int]) -> int:
    return torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(shape), 1).nbytes


def packed_bytes(shapes: Counter) -> int:
    """MKL's packed size of float32 weights of these [out, in] shapes (with counts), measured by
    packing one zero matrix of each shape (once per process): small matrices get a large minimum
    buffer."""
    return sum(count * _packed_size(tuple(shape)) for shape, count in shapes.items())


def packed_weight_bytes(model: nn.Module) -> int:
    """What `pack_linear_weights` will take for `model`."""
    return packed_bytes(Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, LinearBase)))


def _compiled_settings(config, device_type: str):
    """The resolved compile settings if `config` (a RunnerConfig) compiles on one `device_type`
    device, else None."""
    device = config.torch_device
    if not config.compile or config.enforce_eager or device.type != device_type or config.world_size > 1:
        return None
    settings = CompileSettings.resolve(True, config.compile_backend, config.compile_mode, config.compile_scope, device)
    return settings if settings.enabled else None


def cpu_programs_expected(config) -> bool:
    """Whether loading `config` builds the CPU decode programs, as far as the configuration tells:
    an upper bound (the memory rule in `plan_sizes` or, by default, `pays_off` may drop them)."""
    settings = _compiled_settings(config, "cpu")
    return (settings is not None and settings.backend == "inductor" and config.compile_sizes != []
            and config.torch_dtype == torch.float32 and torch.backends.mkl.is_available()
            and os.environ.get(WARM_START_ENV, "").strip().lower() != "jit")


def _available_memory() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _usable_sizes(configured: list[int] | None, device_type: str, max_num_seqs: int) -> list[int]:
    sizes = default_sizes(device_type, max_num_seqs) if configured is None else configured
    return [s for s in sizes if s <= max_num_seqs]


def cuda_capture_plan(config, hf_config, max_model_len: int, total_bytes: int) -> tuple[list[int], int, str]:
    """The CUDA capture sizes, the memory the KV-pool plan leaves for their graphs' private pool,
    and why. The pool holds the activation peak of the largest size's static-length decode (the
    graphs share it, captured largest first); sizes whose peak would exceed GRAPH_MEMORY_FRACTION
    of the device's `total_bytes` are not captured (the keys of max_model_len tokens are gathered
    per sequence: at 256 sequences x 4096 tokens that is gigabytes). ([], 0, why) where no
    runner-level graphs will be captured."""
    from runner_core.memory.estimate import estimate_activation_peak
    from runner_core.memory.shapes import ModelShape

    settings = _compiled_settings(config, "cuda")
    sizes = _usable_sizes(config.compile_sizes, "cuda", config.max_num_seqs)
    if settings is None or not sizes:
        return [], 0, "not compiling on one CUDA device, or no capture sizes"
    if settings.backend == "inductor" and settings.mode in CUDA_GRAPH_MODES:
        return [], 0, f"compile_mode={settings.mode!r}: inductor captures its own CUDA graphs"
    shape = ModelShape.from_hf_config(hf_config)
    peaks = {s: estimate_activation_peak(shape, num_tokens=s, num_seqs=s, dtype=config.torch_dtype,
                                         context_len=max_model_len, decode_gather=True) for s in sizes}
    budget = int(total_bytes * GRAPH_MEMORY_FRACTION)
    kept = [s for s in sizes if peaks[s] <= budget]
    why = "configured" if config.compile_sizes is not None else "device default"
    if len(kept) < len(sizes):
        why += (f"; sizes {[s for s in sizes if s not in kept]} left out: their static-length decode would hold "
                f"over {GRAPH_MEMORY_FRACTION:.0%} of the device ({budget / 2**30:.1f} GiB)")
    return kept, (peaks[max(kept)] if kept else 0), why


def plan_sizes(configured: list[int] | None, model: nn.Module, dtype: torch.dtype, max_num_seqs: int,
               route: str) -> tuple[list[int], str]:
    """The CPU decode sizes to build and why (an empty list says why there are none); CUDA's
    are `cuda_capture_plan`'s."""
    if route != "aoti":
        return [], f"the {route!r} route: CPU decode programs are AOTInductor packages"
    if not torch.backends.mkl.is_available() or dtype != torch.float32:
        return [], "MKL's packed GEMM needs float32 weights and a torch built with MKL"
    usable = _usable_sizes(configured, "cpu", max_num_seqs)
    if configured is not None and len(usable) < len(configured):
        logger.info("compile_sizes above max_num_seqs=%d are never used: %s", max_num_seqs,
                    [s for s in configured if s > max_num_seqs])
    if usable:
        need, free = packed_weight_bytes(model), _available_memory()
        if free is not None and need > free // 2:
            return [], (f"prepacked weights ({need / 2**30:.1f} GiB) would take over half the available "
                        f"memory ({free / 2**30:.1f} GiB)")
    return usable, "configured" if configured is not None else "device default"


class DecodePrograms:
    """Static programs by decode batch size; `padded_size` routes a batch, `run` executes it."""

    kind = ""
    static_decode_len: int | None = None  # the decodes' fixed key length (CUDA graphs); None: as needed

    def __init__(self, model: nn.Module, sizes: list[int]):
        self.model, self.sizes = model, sorted(sizes)
        self.build_seconds: dict[int, float] = {}
        self.runs = dict.fromkeys(self.sizes, 0)
        self.padded_rows = 0

    def padded_size(self, num_decodes: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_decodes)
        return self.sizes[i] if i < len(self.sizes) else None

    def build(self, run_dummy: Callable[..., tuple]) -> "DecodePrograms":
        """Build (or load) and warm up every size; `run_dummy` is ForwardPass.dummy_decode."""
        from tqdm.auto import tqdm

        for s in tqdm(self.sizes[::-1], desc=f"decode programs ({self.kind})", leave=False, disable=None):
            t = time.perf_counter()
            self._build_size(s, run_dummy)
            self.build_seconds[s] = time.perf_counter() - t
        return self

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, num_real: int) -> torch.Tensor | None:
        """Hidden states [S, H] if a program of this size exists, else None."""
        n = input_ids.shape[0]
        if n not in self.runs:
            return None
        self.runs[n] += 1
        self.padded_rows += n - num_real
        return self._run(n, input_ids, positions, meta)

    def stats(self) -> dict:
        return {"kind": self.kind, "sizes": self.sizes, "build_seconds": dict(self.build_seconds),
                "runs": dict(self.runs), "padded_rows": self.padded_rows}

    def _build_size(self, size: int, run_dummy) -> None:
        raise NotImplementedError

    def _run(self, n, input_ids, positions, meta) -> torch.Tensor:
        raise NotImplementedError


class PackedDecodePrograms(DecodePrograms):
    """CPU: one AOTInductor package per size, exported for exactly that many tokens with every
    linear layer on MKL's packed GEMM (its prepacked weights are inputs made at load). One packed
    copy is made, for the smallest size: MKL runs any other row count on the plain weight (same
    results, no gain), so further sizes only save the general program's dynamic-shape overhead."""

    kind = "AOTInductor, static size, MKL-prepacked weights"

    def __init__(self, model: nn.Module, sizes: list[int], optimizer):
        super().__init__(model, sizes)
        self.memory_bytes = pack_linear_weights(model, sizes[0])
        self.calls, self.cache = {}, {}
        for size in sizes:
            program = AOTIProgram(optimizer, size)
            self.cache[size] = program.load_cached()
            self.calls[size] = AOTICall(model, program)

    def _build_size(self, size: int, run_dummy) -> None:
        """Export, compile and save the package on a cache miss (else it is loaded already), then
        run it once on a stateless dummy step (the pool is not touched)."""
        ids, positions, meta = run_dummy(size)
        with torch.inference_mode(), set_forward_context(meta, False):
            self._run(size, ids, positions, meta)

    def _run(self, n, input_ids, positions, meta) -> torch.Tensor:
        return self.calls[n](input_ids, positions)

    def pays_off(self, run_dummy, rounds: int = 5) -> tuple[bool, str]:
        """Time the smallest size's program against the general program on one stateless dummy
        step (best of `rounds` alternating runs of each): (at least MIN_GAIN faster?, the figures).
        The packed GEMM pays where the matmuls dominate (small-llama: 7.4 vs 9.7 ms); on tiny
        models it gains little (tiny-llama: 0.59 vs 0.63 ms) for 28x its weights in packed buffers."""
        size = self.sizes[0]
        ids, positions, meta = run_dummy(size)
        runs = {"program": lambda: self._run(size, ids, positions, meta), "general": lambda: self.model(ids, positions)}
        best = dict.fromkeys(runs, float("inf"))
        with torch.inference_mode(), set_forward_context(meta, False):
            for _ in range(rounds):
                for name, fn in runs.items():
                    t = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t)
        figures = (f"measured {best['program'] * 1e3:.2f} ms per {size}-token step vs "
                   f"{best['general'] * 1e3:.2f} ms for the general program")
        return best["program"] <= MIN_GAIN * best["general"], figures

    def release(self) -> None:
        """Drop the packed weights (the programs are not to be used)."""
        unpack_linear_weights(self.model)
        self.memory_bytes = 0

    def stats(self) -> dict:
        misses = sum(call.program.misses for call in self.calls.values())
        return {**super().stats(), "cache": dict(self.cache), "memory_bytes": self.memory_bytes, "misses": misses}


class CUDAGraphDecodePrograms(DecodePrograms):
    kind = "CUDA graphs"

    def __init__(self, model: nn.Module, sizes: list[int], static_decode_len: int):
        super().__init__(model, sizes)
        self.static_decode_len = static_decode_len  # max_model_len in whole blocks
        self.graphs: dict[int, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.memory_bytes = 0

    def _build_size(self, size: int, run_dummy) -> None:
        """Capture `size` tokens: warm up on a side stream, then record the model over the static
        tensors `run_dummy` leaves (ids, positions, metadata of a decode step of that size over
        block 0, which the warm-up runs write: the engine frees it of cached prefixes first)."""
        ids, positions, meta = run_dummy(size, self.static_decode_len)
        before = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode(), set_forward_context(meta, True):
            for _ in range(2):
                self.model(ids, positions)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), set_forward_context(meta, True), torch.cuda.graph(graph, pool=self.pool):
            out = self.model(ids, positions)
        torch.cuda.synchronize()
        self.memory_bytes += torch.cuda.memory_reserved() - before
        self.graphs[size] = (graph, ids, positions, meta, out)

    def _run(self, n, input_ids, positions, meta) -> torch.Tensor:
        graph, ids, pos, static, out = self.graphs[n]
        ids.copy_(input_ids)
        pos.copy_(positions)
        for name, value in vars(meta).items():
            if isinstance(value, torch.Tensor):
                getattr(static, name).copy_(value)
        graph.replay()
        return out

    def stats(self) -> dict:
        return {**super().stats(), "memory_bytes": self.memory_bytes}
