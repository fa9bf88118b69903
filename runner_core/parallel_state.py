"""Tensor/pipeline parallel state seen by the layers: ranks, sizes and the collectives.

With no process group initialised everything is the single-rank identity, so the
layers are written tensor-parallel aware while running in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def set_tensor_parallel_group(group: dist.ProcessGroup | None) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_size() -> int:
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def get_tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_GROUP is not None and get_tp_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_GROUP is None or get_tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(get_tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor parallel size {denominator}")
    return numerator // denominator
