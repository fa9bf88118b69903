"""The routing record: what the experts layers report about one forward, without model arguments.

The worker opens a record around a forward (`recording_routing`); each fused-experts call of the
forward (layers/fused_moe.py, in layer order) adds its layer's per-expert token counts — skipping
the pad rows a decode program appends at the end of the batch — and, when asked, a copy of its
router logits. Like the forward context of layers/attention.py it is a ContextVar read inside the
opaque `runner_core::fused_moe` op, so eager, compiled (dynamo or AOTInductor, which call the op's
Python kernel) and CPU decode-program runs all report the same way. With no record open (compile
warm-up, profiling) nothing is recorded.

`gather_layers` places a pipeline stage's rows at their global MoE-layer positions and sums the
stages on every rank, so rank 0 sees every layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from runner_core.distributed.parallel_state import get_pp_stage, get_tp_rank, world_all_reduce


class RoutingRecord:
    """Per-layer results of one forward, in the order the MoE layers ran."""

    def __init__(self, num_pad_tokens: int = 0, capture_logits: bool = False):
        self.num_pad_tokens, self.capture_logits = num_pad_tokens, capture_logits
        self.counts: list[torch.Tensor] = []  # [E] int64 per MoE layer
        self.logits: list[torch.Tensor] = []  # [N, E] per MoE layer (capture_logits)

    def add(self, router_logits: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> None:
        real = topk_ids.shape[0] - self.num_pad_tokens
        self.counts.append(torch.bincount(topk_ids[:real].reshape(-1), minlength=num_experts))
        if self.capture_logits:  # a copy: a compiled program reuses its intermediate buffers
            self.logits.append(router_logits[:real].clone())


_RECORD: ContextVar[RoutingRecord | None] = ContextVar("runner_core_routing_record", default=None)


@contextmanager
def recording_routing(num_pad_tokens: int = 0, capture_logits: bool = False) -> Iterator[RoutingRecord]:
    record = RoutingRecord(num_pad_tokens, capture_logits)
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def current_record() -> RoutingRecord | None:
    return _RECORD.get()


def gather_layers(local: list[torch.Tensor], local_rows: list[int], num_rows: int,
                  row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[num_rows, *row_shape]: this rank's per-layer tensors at rows `local_rows`, the other pipeline
    stages' at theirs (every rank calls it in a pipeline-parallel runner: one all-reduce, to which
    only each stage's first TP rank contributes; TP ranks compute the same values)."""
    stage = get_pp_stage()
    if stage is None or stage.size == 1:
        return torch.stack(local) if local else torch.zeros(num_rows, *row_shape, dtype=dtype, device=device)
    full = torch.zeros(num_rows, *row_shape, dtype=dtype, device=device)
    if local and get_tp_rank() == 0:
        full[torch.tensor(local_rows, device=device)] = torch.stack(local).to(dtype)
    return world_all_reduce(full)
