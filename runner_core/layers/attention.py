"""Paged attention over a flat token batch.

The batch is laid out decodes first (one query token per sequence), then prefill
chunks. K/V of every token are written into the KV pool at `slot_mapping`; queries
then read their sequence's keys by one of three backends, chosen by ForwardPass
(`attention_backend`). Each backend is one module holding its metadata class, the builder that
makes it from the step's `CommonAttentionMetadata` once per step for all layers, and its
`attend`: "gather" (gather_attention.py) copies each sequence's keys out of the pool through
gather indices derived from block tables; "native" (native_attention.py) runs the CPU kernel over
the pool in place for every token; "flex" (flex_attention.py) runs FlexAttention over the pool in
place for every token. Under torch.compile the whole of it is one custom op, opaque to the graph, declared as writing
the pool (tests/test_custom_ops.py checks every op's schema with torch.library.opcheck).

The forward context (the step's metadata, and whether the KV pool is used) is set by ForwardPass
around a model call and read here; keeping it out of the model's arguments lets the model's
forward be compiled as a graph over plain tensors (input ids, positions), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from runner_core.errors import ConfigError
from runner_core.kernels import cpu_kernels_available

ATTENTION_BACKENDS = ("auto", "flex", "native", "gather")  # RunnerConfig.attention_backend's choices


@dataclass
class CommonAttentionMetadata:
    """A step's shape as every backend's builder reads it (vLLM's CommonAttentionMetadata), CPU tensors
    built once per step: by InputBuffers.fill for a step over the pool, by `without_pool` for a
    stateless forward. Sequences are laid out decodes (one new token) first."""

    starts: torch.Tensor  # [S] first new position of each sequence (the tokens before it are in the pool)
    query_lens: torch.Tensor  # [S] new tokens of each sequence
    num_decodes: int  # the first sequences with one new token (a decode program's pad rows included)
    positions: torch.Tensor  # [N]
    block_size: int
    sliding_window: int | None
    slot_mapping: torch.Tensor | None = None  # [N] pool slot of each token; None: no pool (a stateless forward)
    # [S, W] each sequence's blocks, zeros past them; W is the longest table's, or every column with decode_len
    block_tables: torch.Tensor | None = None
    decode_len: int | None = None  # the decodes' fixed key length (CUDA graphs: one shape per batch size)
    num_pool_blocks: int = 0  # blocks in the pool (what the flex backend maps block ids over)

    @classmethod
    def without_pool(cls, starts: list[int], query_lens: list[int], num_decodes: int, block_size: int,
                     sliding_window: int | None) -> CommonAttentionMetadata:
        """Independent sequences attending over the step's own tokens (a stateless forward)."""
        start_t, qlen_t = torch.tensor(starts), torch.tensor(query_lens)
        offsets = torch.cumsum(qlen_t, 0) - qlen_t
        positions = torch.arange(int(qlen_t.sum())) - torch.repeat_interleave(offsets - start_t, qlen_t)
        return cls(start_t, qlen_t, num_decodes, positions, block_size, sliding_window)


class AttentionMetadataBuilder:
    """Builds a backend's metadata from the step's common metadata, once per step for every layer
    (each backend module has one: gather_attention.py, native_attention.py, flex_attention.py)."""

    def build(self, common: CommonAttentionMetadata):
        """The backend's metadata (CPU tensors), whose `attend` the attention layers call."""
        raise NotImplementedError

    def finish(self, meta, common: CommonAttentionMetadata) -> None:
        """Complete `meta` once it is on the device (default: nothing to do)."""


def default_backend(device_type: str) -> str:
    """What "auto" runs as on a device type: flex on CUDA, the native kernel on the CPU when built, else gather."""
    return "flex" if device_type == "cuda" else "native" if cpu_kernels_available() else "gather"


def resolve_attention_backend(choice: str, device: torch.device, block_size: int) -> str:
    """The backend `choice` (RunnerConfig.attention_backend) runs as on `device`: "auto" is flex on
    CUDA, the native kernel on the CPU when it is built, else gather."""
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(f"config field 'attention_backend' got {choice!r}; allowed: one of "
                          + ", ".join(map(repr, ATTENTION_BACKENDS)))
    if choice == "auto":
        choice = default_backend(device.type)
    if choice == "native" and (device.type != "cpu" or not cpu_kernels_available()):
        why = "it is a CPU kernel" if device.type != "cpu" else "it did not build (see the warning logged above)"
        raise ConfigError(f"config field 'attention_backend' got 'native' on {device.type}, but {why}; "
                          "use 'auto', 'flex' or 'gather'")
    if choice == "flex" and device.type == "cuda" and block_size < 16:
        raise ConfigError(f"config field 'attention_backend' got 'flex' with block_size={block_size}; on CUDA "
                          "its kernel needs block_size >= 16 (one Triton tile per block): raise block_size")
    return choice


# ---- the forward context: the step's metadata, set by ForwardPass around a model call -----------
@dataclass
class ForwardContext:
    meta: object  # the backend's metadata (GatherMetadata, NativeMetadata, FlexMetadata)
    use_kv_cache: bool  # False for a stateless forward (no pool: attend over the step's own tokens)
    # image features to place in the embeddings: (flat token positions [M], features [M, H]), or None
    multimodal: tuple[torch.Tensor, torch.Tensor] | None = None


# per thread (and task): runners stepping on different threads never see each other's step
_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("runner_core_forward_context", default=None)


@contextmanager
def set_forward_context(meta, use_kv_cache: bool, multimodal=None) -> Iterator[None]:
    token = _CONTEXT.set(ForwardContext(meta, use_kv_cache, multimodal))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("attention ran outside a forward context; call the model through ForwardPass")
    return ctx


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """q: [N, H*Dh], k/v: [N, KVH*Dh] -> [N, H*Dh]. kv_cache is this layer's [2, KVH, slots, Dh]
    view of the pool; the step's metadata comes from the forward context, which also says
    whether the pool is used (a stateless forward attends over the step's own tokens). The
    metadata's backend does the attending (`attend`)."""
    ctx = get_forward_context()
    meta = ctx.meta
    n = q.shape[0]
    q = q.view(n, num_heads, head_dim)
    k = k.view(n, num_kv_heads, head_dim).transpose(0, 1)
    v = v.view(n, num_kv_heads, head_dim).transpose(0, 1)
    if ctx.use_kv_cache:
        kv_cache[0].index_copy_(1, meta.slot_mapping, k)
        kv_cache[1].index_copy_(1, meta.slot_mapping, v)
        k, v = kv_cache[0], kv_cache[1]
    return meta.attend(q, k, v, scale).reshape(n, num_heads * head_dim)


@torch.library.custom_op("runner_core::paged_attention", mutates_args=("kv_cache",),
                         tags=(torch.Tag.cudagraph_unsafe,))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                       num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """`paged_attention` as one opaque op, so a compiled graph neither traces nor breaks on it. Its
    schema declares that it writes `kv_cache` (the step's K/V go into the pool), so compiled and
    AOTInductor graphs know the pool they take as an input changes under them. It is tagged
    `cudagraph_unsafe`: it reads the step's metadata from the forward context, not from its inputs, so
    inductor's CUDA graph trees (compile modes reduce-overhead, max-autotune) must not record it; they
    partition each graph around it and run it outside every replay (docs/compile.md)."""
    return paged_attention(q, k, v, kv_cache, num_heads, num_kv_heads, head_dim, scale)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, num_heads, num_kv_heads, head_dim, scale):
    return torch.empty_like(q)


class Attention(nn.Module):
    """Holds its layer's view of the KV pool as a buffer (bound by `bind_kv_cache`), so every
    layer runs the same code with its pool slice as an input: regional compilation compiles
    one layer and reuses it for all."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.register_buffer("kv_cache", torch.empty(0), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fn = paged_attention_op if torch.compiler.is_compiling() else paged_attention
        return fn(q, k, v, self.kv_cache, self.num_heads, self.num_kv_heads, self.head_dim, self.scale)


def bind_kv_cache(model: nn.Module, kv_caches: torch.Tensor) -> None:
    """Give each attention layer, in order, its [2, KVH, slots, Dh] slice of the pool."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != kv_caches.shape[0]:
        raise ValueError(f"the pool has {kv_caches.shape[0]} layers, the model {len(layers)} attention layers")
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache
