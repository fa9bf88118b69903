"""DecodePrograms: static-shape programs for pure-decode steps of chosen batch sizes (vLLM's
compile sizes and CUDA-graph capture sizes). Which sizes, and building them: decode_plan.py.

* CPU (`PackedDecodePrograms`, AOTInductor route): one package per size, exported for exactly that
  many tokens with every linear layer on MKL's packed GEMM, on weights the runner packs at load and
  passes as program inputs (the packed buffer holds address-dependent metadata, so no package can
  store it): the warm start stays a package load. The packed copies' bytes are `memory_bytes`.
* CUDA (`CUDAGraphDecodePrograms`): each size captured as a CUDA graph over the model as it is
  (eager or compiled without inductor's own graphs) on static input and metadata tensors; a replay
  copies the step's inputs and metadata into them. Graph memory is measured into `memory_bytes`.

Padding: a decode batch of D sequences runs at the smallest size S >= D; the S - D pad rows repeat
the first row (token, position, slot, block table), so they write the values that row writes to the
slot it writes and read what it reads; their outputs are dropped. No slot is reserved for them.

When the KV pool moves (a shrink re-allocates it), programs that keep its address (CUDA graphs:
`holds_pool_address`) are rebuilt over the new tensor (`rebuild`, called by the worker); the CPU
packages take the pool as an input of every call and need nothing.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch
from torch import nn

from runner_core.compile.aoti_program import AOTICall, AOTIProgram
from runner_core.layers.attention import set_forward_context
from runner_core.layers.linear import pack_linear_weights, unpack_linear_weights
from runner_core.progress import progress, ticking

MIN_GAIN = 0.9  # the default CPU decode program is kept when it takes at most 90% of the general program's time

class DecodePrograms:
    """Static programs by decode batch size; `padded_size` routes a batch, `run` executes it."""

    kind = ""
    static_decode_len: int | None = None  # the decodes' fixed key length (CUDA graphs); None: as needed
    memory_bytes = 0  # what the programs hold beyond the model (prepacked weights, graph pools)
    holds_pool_address = False  # True: built over the KV pool's address, so rebuilt when the pool moves

    def __init__(self, model: nn.Module, sizes: list[int]):
        self.model, self.sizes = model, sorted(sizes)
        self.build_seconds: dict[int, float] = {}
        self.runs = dict.fromkeys(self.sizes, 0)
        self.padded_rows = 0
        self.rebuilds = 0  # times the pool moved and the programs were built again over it

    def padded_size(self, num_decodes: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_decodes)
        return self.sizes[i] if i < len(self.sizes) else None

    def build(self, run_dummy: Callable[..., tuple]) -> DecodePrograms:
        """Build (or load) and warm up every size; `run_dummy` is ForwardPass.dummy_decode."""
        with progress(desc=f"decode programs ({self.kind})", total=len(self.sizes), unit="size") as bar, \
                ticking(bar):
            for s in self.sizes[::-1]:
                bar.set_postfix_str(f"batch of {s}")
                t = time.perf_counter()
                self._build_size(s, run_dummy)
                self.build_seconds[s] = time.perf_counter() - t
                bar.update(1)
            bar.set_postfix_str(", ".join(f"batch {k}: {v:.1f} s" for k, v in sorted(self.build_seconds.items())))
        return self

    def rebuild(self, run_dummy: Callable[..., tuple]) -> DecodePrograms:
        """Drop what was built and build every size again, over the pool the model is bound to now
        (the caller keeps whatever the warm-up writes into the pool: Worker)."""
        self._drop()
        self.build_seconds.clear()
        self.rebuilds += 1
        return self.build(run_dummy)

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
                "runs": dict(self.runs), "padded_rows": self.padded_rows, "rebuilds": self.rebuilds}

    def _build_size(self, size: int, run_dummy) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        """Release what `_build_size` made (before a rebuild)."""
        raise NotImplementedError

    def _run(self, n, input_ids, positions, meta) -> torch.Tensor:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what the programs hold in the model (the CPU programs' packed weights): they are not to be used."""


class PackedDecodePrograms(DecodePrograms):
    """CPU: one AOTInductor package per size, exported for exactly that many tokens. Linear weights stored
    as the kernels' panels (or quantized) are multiplied as they are; row-major ones (the kernels off) go
    through MKL's packed GEMM (their prepacked copies are inputs made at load). One packed copy is made,
    for the smallest size: MKL runs any other row count on the plain weight (same results, no gain), so
    further sizes only save the general program's dynamic-shape overhead."""

    def __init__(self, model: nn.Module, sizes: list[int], optimizer):
        super().__init__(model, sizes)
        self.calls, self.cache = {}, {}
        for size in sizes:
            program = AOTIProgram(optimizer, size)
            self.cache[size] = program.load_cached()
            self.calls[size] = AOTICall(model, program)
        # an MKL copy of the linear weights that stay row-major (the kernels off), made here and dropped only by
        # `release`; stored ones are multiplied as they are (weight_storage.py: no second copy)
        self.memory_bytes = pack_linear_weights(model, sizes[0])
        self.kind = "AOTInductor, static size, " + ("MKL-prepacked weights" if self.memory_bytes else "stored weights")

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
        The packed GEMM pays where the matmuls dominate; on tiny models it gains little for many
        times their weights in packed buffers (docs/compile.md)."""
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
    holds_pool_address = True  # a graph replays the kernels on the addresses it was captured with

    def __init__(self, model: nn.Module, sizes: list[int], static_decode_len: int, device: torch.device):
        super().__init__(model, sizes)
        self.static_decode_len = static_decode_len  # max_model_len in whole blocks
        self.device = device  # the runner's, made current around every capture (streams, pools and memory figures
        self.graphs: dict[int, tuple] = {}  # follow the current device, which may be another GPU: cuda:1's runner)
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()
        self.memory_bytes = 0

    def _build_size(self, size: int, run_dummy) -> None:
        """Capture `size` tokens on the runner's device: warm up on a side stream, then record the model
        over the static tensors `run_dummy` leaves (ids, positions, metadata of a decode step of that size
        over block 0, which the warm-up runs write: the engine frees it of cached prefixes first, and a
        rebuild restores its contents afterwards)."""
        with torch.cuda.device(self.device):
            ids, positions, meta = run_dummy(size, self.static_decode_len)
            before = torch.cuda.memory_reserved(self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode(), set_forward_context(meta, True):
                for _ in range(2):
                    self.model(ids, positions)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), set_forward_context(meta, True), torch.cuda.graph(graph, pool=self.pool):
                out = self.model(ids, positions)
            torch.cuda.synchronize(self.device)
            self.memory_bytes += torch.cuda.memory_reserved(self.device) - before
        self.graphs[size] = (graph, ids, positions, meta, out)

    def _drop(self) -> None:
        """Free the graphs and their pool, so the recapture's memory is measured anew."""
        self.graphs.clear()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.pool = torch.cuda.graph_pool_handle()
        self.memory_bytes = 0

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
