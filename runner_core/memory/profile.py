"""Profile run: the peak transient memory of one forward pass, measured.

`profile_activation_peak(run, device)` returns the peak bytes allocated while `run()` executes
(the worker passes a dummy batch of `dummy_batch`'s shape through its forward pass and LM head)
beyond what was allocated before. On CUDA the caching allocator's peak statistic is used; on the
CPU, where torch keeps no allocator statistics, the allocation and free events of
`torch.profiler.profile(profile_memory=True)` are replayed to find the running peak.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger("runner_core")


def dummy_batch(num_tokens: int, num_seqs: int) -> list[list[int]]:
    """`num_seqs` sequences of token id 0 totalling `num_tokens`: `num_seqs - 1` one-token
    sequences (decodes) and one prefill holding the rest, the busiest step the scheduler forms
    (every running sequence decoding plus one prefill chunk). `num_seqs` is capped at `num_tokens`."""
    if num_tokens < 1 or num_seqs < 1:
        raise ValueError(f"num_tokens and num_seqs must be >= 1, got {num_tokens} and {num_seqs}")
    num_seqs = min(num_seqs, num_tokens)
    return [[0] * (num_tokens - num_seqs + 1)] + [[0]] * (num_seqs - 1)


@contextmanager
def _fd2_to_null() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def quiet_profile(**kwargs) -> Iterator:
    """`torch.profiler.profile(**kwargs)` whose start and stop print nothing: kineto writes "USDT ...
    profiler_start/stop" straight to file descriptor 2 at every KINETO_LOG_LEVEL (red lines in a
    notebook that the user can do nothing about). Only those two calls are silenced, not the work."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _fd2_to_null():
        prof.start()
    try:
        yield prof
    finally:
        with _fd2_to_null():
            prof.stop()


def _cpu_peak(fn) -> int:
    """Peak of (bytes allocated - bytes freed) on the CPU while `fn()` runs, from profiler events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.id, event.extra_fields.alloc_size))
    # frees of blocks allocated before profiling started are not reported, so the running sum
    # counts only memory allocated during `fn`
    current = peak = 0
    for _, _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


def profile_activation_peak(run: Callable[[], None], device: torch.device | str) -> int:
    """Peak bytes allocated on `device` while `run()` executes, beyond what was allocated before."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _cpu_peak(run)
    logger.debug("profile run: activation peak %.1f MiB", peak / 2**20)
    return max(0, int(peak))
