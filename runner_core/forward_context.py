"""The forward context: per-step attention metadata (and whether the KV pool is used), set by
ForwardPass around a model call and read by the attention layers.

Keeping them out of the model's arguments lets the model's forward be compiled as a graph over
plain tensors (input ids, positions), with attention an opaque custom op (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class ForwardContext:
    meta: object  # AttentionMetadata
    use_kv_cache: bool  # False for a stateless forward (no pool: attend over the step's own tokens)


# per thread (and task): runners stepping on different threads never see each other's step
_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("runner_core_forward_context", default=None)


@contextmanager
def set_forward_context(meta, use_kv_cache: bool) -> Iterator[None]:
    token = _CONTEXT.set(ForwardContext(meta, use_kv_cache))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("attention ran outside a forward context; call the model through ForwardPass")
    return ctx
