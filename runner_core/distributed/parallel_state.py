"""Tensor/pipeline parallel state seen by the layers and the worker: ranks, sizes, the pipeline
stage and the collectives.

With no process group active everything is the single-rank identity, so the layers and the
worker are written parallel-aware while running in one process. A parallel runner makes its
groups active only while it builds or runs its model (`parallel_context`), and only on the
calling thread (a `threading.local`, which torch.compile guards on), so a single-process runner
in the same interpreter, on this or another thread, never sees them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

_LOCAL = threading.local()  # .tp_group, .pp_stage, .world_group of the calling thread (absent: single rank)


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This rank's pipeline stage: decoder layers [start_layer, end_layer) of the model, the global
    ranks it receives hidden states from and sends them to (None at either end), this process's
    global rank and the one that hands the last stage's outputs to rank 0."""

    rank: int
    size: int
    start_layer: int
    end_layer: int
    prev_rank: int | None
    next_rank: int | None
    global_rank: int
    last_stage_rank: int  # global rank of the last stage's first TP rank

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


# ---- activation ------------------------------------------------------------------------------
def _tp_group() -> dist.ProcessGroup | None:
    return getattr(_LOCAL, "tp_group", None)


@contextmanager
def parallel_context(tp_group: dist.ProcessGroup | None, stage: PipelineStage | None,
                     world_group: dist.ProcessGroup | None) -> Iterator[None]:
    """Make `tp_group`, `stage` and `world_group` (every rank) the ones seen on this thread, for the block."""
    previous = _tp_group(), get_pp_stage(), getattr(_LOCAL, "world_group", None)
    _LOCAL.tp_group, _LOCAL.pp_stage, _LOCAL.world_group = tp_group, stage, world_group
    try:
        yield
    finally:
        _LOCAL.tp_group, _LOCAL.pp_stage, _LOCAL.world_group = previous


def get_tp_size() -> int:
    group = _tp_group()
    return 1 if group is None else dist.get_world_size(group)


def get_tp_rank() -> int:
    group = _tp_group()
    return 0 if group is None else dist.get_rank(group)


def get_pp_stage() -> PipelineStage | None:
    """The active pipeline stage, or None without pipeline parallelism."""
    return getattr(_LOCAL, "pp_stage", None)


# ---- communication figures -------------------------------------------------------------------
class CommStats:
    """Calls, bytes and seconds spent in each kind of collective by this process (cheap counters,
    touched only on the parallel path). On CUDA the seconds are launch times (NCCL is async).
    "broadcast" is rank 0's command broadcasts (pickled objects: calls and seconds only); the
    seconds of a collective include waiting for the slowest rank."""

    KINDS = ("all_reduce", "all_gather", "send", "recv", "broadcast")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = dict.fromkeys(self.KINDS, 0)
        self.bytes = dict.fromkeys(self.KINDS, 0)
        self.seconds = dict.fromkeys(self.KINDS, 0.0)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.seconds[kind] += seconds

    def as_dict(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "seconds": dict(self.seconds),
                "total_bytes": sum(self.bytes.values()), "total_seconds": sum(self.seconds.values())}


COMM_STATS = CommStats()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ---- collectives -----------------------------------------------------------------------------
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    group = _tp_group()
    if group is not None and dist.get_world_size(group) > 1:
        if torch.compiler.is_compiling():
            dist.all_reduce(x, group=group)
            return x
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        COMM_STATS.add("all_reduce", _nbytes(x), time.perf_counter() - t)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    group = _tp_group()
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    if torch.compiler.is_compiling():
        dist.all_gather(parts, x.contiguous(), group=group)
    else:
        t = time.perf_counter()
        dist.all_gather(parts, x.contiguous(), group=group)
        COMM_STATS.add("all_gather", _nbytes(x) * len(parts), time.perf_counter() - t)
    return torch.cat(parts, dim=dim)


def pp_send(x: torch.Tensor, dst: int) -> None:
    """Send a tensor to global rank `dst` (the next pipeline stage, or rank 0 for the logits)."""
    t = time.perf_counter()
    dist.send(x.contiguous(), dst)
    COMM_STATS.add("send", _nbytes(x), time.perf_counter() - t)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    """Receive a tensor of a known shape from global rank `src`."""
    t = time.perf_counter()
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src)
    COMM_STATS.add("recv", _nbytes(x), time.perf_counter() - t)
    return x


def min_over_ranks(n: int) -> int:
    """The smallest `n` any rank holds (every rank calls it); `n` itself in one process."""
    group = getattr(_LOCAL, "world_group", None)
    if group is None:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t)


def world_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over every rank (every rank calls it); `x` itself in one process."""
    group = getattr(_LOCAL, "world_group", None)
    if group is None:
        return x
    t = time.perf_counter()
    dist.all_reduce(x, group=group)
    COMM_STATS.add("all_reduce", _nbytes(x), time.perf_counter() - t)
    return x


def to_driver(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The last pipeline stage's `x` (of `shape`) on rank 0, which drives the engine; `x` itself
    without pipeline parallelism, and on ranks that neither send nor receive it."""
    stage = get_pp_stage()
    if stage is None or stage.last_stage_rank == 0 or not shape[0]:
        return x
    if stage.global_rank == stage.last_stage_rank:
        pp_send(x, 0)
    elif stage.global_rank == 0:
        return pp_recv(shape, x.dtype, x.device, stage.last_stage_rank)
    return x


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor parallel size {denominator}")
    return numerator // denominator
