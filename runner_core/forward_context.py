"""The forward context: per-step attention metadata and the KV pool, set by ForwardPass around a
model call and read by the attention layers.

Keeping them out of the model's arguments lets the model's forward be compiled as a graph over
plain tensors (input ids, positions), with attention an opaque custom op (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    meta: object  # AttentionMetadata
    kv_caches: torch.Tensor | None  # [layers, 2, kv_heads, slots, head_dim], None for a stateless forward


_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(meta, kv_caches: torch.Tensor | None) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ForwardContext(meta, kv_caches)
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside a forward context; call the model through ForwardPass")
    return _CONTEXT
