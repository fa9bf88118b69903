"""Paged attention over a flat token batch.

The batch is laid out decodes first (one query token per sequence), then prefill
chunks. K/V of every token are written into the KV pool at `slot_mapping`; queries
then read their sequence's keys by one of three backends, chosen by ForwardPass
(`attention_backend`) through the metadata it builds once per step for all layers:
"gather" copies each sequence's keys out of the pool through gather indices derived
from block tables; "native" runs the CPU kernel over the pool in place for every token;
"flex" runs FlexAttention over the pool in place for every token (flex_attention.py).
Under torch.compile the whole of it is one custom op, opaque to the graph, declared as writing
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
import torch.nn.functional as F
from torch import nn

from runner_core.config import ATTENTION_BACKENDS
from runner_core.errors import ConfigError
from runner_core.kernels import cpu_kernels_available, native_paged_attention
from runner_core.layers.flex_attention import flex_paged_attention


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    For the decode part, `decode_kv_idx[i, j]` is the pool slot of the j-th key of
    decode sequence i. For the prefill part, queries are scattered into a padded
    [num_prefills, max_query_len] grid by `prefill_q_idx`, and keys gathered through
    `prefill_kv_idx` from the pool (or, with no pool, from the step's own tokens).
    The prefill mask is True where a query may attend; the decode mask is an additive bias.
    """

    slot_mapping: torch.Tensor | None  # [N] pool slot of each token, None when there is no KV pool
    num_decode_tokens: int
    decode_kv_idx: torch.Tensor | None  # [D, L_d]
    decode_bias: torch.Tensor | None  # [1, D, 1, L_d] additive: 0 where visible, -inf elsewhere
    num_prefills: int
    max_query_len: int
    prefill_q_idx: torch.Tensor | None  # [N - D] position of each prefill token in the padded grid
    prefill_kv_idx: torch.Tensor | None  # [P, L_p]
    prefill_mask: torch.Tensor | None  # [P, 1, max_query_len, L_p]; None: plain causal (fresh prompts)
    # set instead of all the gather fields when the native kernel runs every row over the pool in place
    native_block_tables: torch.Tensor | None = None  # [S, max_blocks]
    native_row_seq: torch.Tensor | None = None  # [N] each token's sequence (its row of the block tables)
    native_context_lens: torch.Tensor | None = None  # [N] keys 0..len-1 of its sequence: its position + 1
    block_size: int = 0
    sliding_window: int | None = None
    # set instead of all the above (but the slot mapping) by the flex backend: flex_attention.py
    flex_q_rows: torch.Tensor | None = None  # [N]
    flex_row_seq: torch.Tensor | None = None  # [R]
    flex_row_pos: torch.Tensor | None = None  # [R]
    flex_kv_num_blocks: torch.Tensor | None = None  # [1, 1, R / Q_BLOCK]
    flex_kv_indices: torch.Tensor | None = None  # [1, 1, R / Q_BLOCK, W]
    flex_full_kv_num_blocks: torch.Tensor | None = None  # [1, 1, R / Q_BLOCK]
    flex_full_kv_indices: torch.Tensor | None = None  # [1, 1, R / Q_BLOCK, W]
    flex_block_tables: torch.Tensor | None = None  # [S, W]
    flex_num_blocks: torch.Tensor | None = None  # [S]
    flex_logical_of: torch.Tensor | None = None  # [pool blocks + 1], made on the device


def resolve_attention_backend(choice: str, device: torch.device, block_size: int) -> str:
    """The backend `choice` (RunnerConfig.attention_backend) runs as on `device`: "auto" is flex on
    CUDA, the native kernel on the CPU when it is built, else gather."""
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(f"config field 'attention_backend' got {choice!r}; allowed: one of "
                          + ", ".join(map(repr, ATTENTION_BACKENDS)))
    if choice == "auto":
        choice = "flex" if device.type == "cuda" else "native" if cpu_kernels_available() else "gather"
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
    meta: AttentionMetadata
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


def _decode(q, k, v, bias, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """One query per sequence. q: [D, H, Dh]; k, v: [KVH, D, L, Dh] (as gathered); bias: [1, D, 1, L].

    Grouped heads fold into the query dimension, so each KV head is read once and no repeat
    of K/V is needed: two batched matmuls over (KVH, D)."""
    d = q.shape[0]
    qg = q.view(d, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [KVH, D, G, Dh]
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(bias)  # [KVH, D, G, L]
    out = torch.matmul(scores.softmax(dim=-1), v)  # [KVH, D, G, Dh]
    return out.transpose(0, 1).reshape(d, num_heads, head_dim)


def _prefill(q, k, v, mask, gqa: bool, scale: float) -> torch.Tensor:
    """q: [P, Lq, H, Dh]; k, v: [KVH, P, Lk, Dh]; mask: [P, 1, Lq, Lk] or None (causal) -> [P, Lq, H, Dh]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """q: [N, H*Dh], k/v: [N, KVH*Dh] -> [N, H*Dh]. kv_cache is this layer's [2, KVH, slots, Dh]
    view of the pool; the step's metadata comes from the forward context, which also says
    whether the pool is used (a stateless forward attends over the step's own tokens)."""
    ctx = get_forward_context()
    meta: AttentionMetadata = ctx.meta
    n = q.shape[0]
    q = q.view(n, num_heads, head_dim)
    k = k.view(n, num_kv_heads, head_dim).transpose(0, 1)
    v = v.view(n, num_kv_heads, head_dim).transpose(0, 1)
    if ctx.use_kv_cache:
        kv_cache[0].index_copy_(1, meta.slot_mapping, k)
        kv_cache[1].index_copy_(1, meta.slot_mapping, v)
        k_src, v_src = kv_cache[0], kv_cache[1]
    else:
        k_src, v_src = k, v
    if ctx.use_kv_cache and meta.flex_q_rows is not None:
        return flex_paged_attention(q, k_src, v_src, meta, scale).reshape(n, num_heads * head_dim)
    out = torch.empty_like(q)
    if ctx.use_kv_cache and meta.native_row_seq is not None:
        native_paged_attention(out, q, k_src, v_src, meta.native_block_tables, meta.native_row_seq,
                               meta.native_context_lens, meta.block_size, scale, meta.sliding_window)
        return out.view(n, num_heads * head_dim)
    d = meta.num_decode_tokens
    if d:
        idx = meta.decode_kv_idx
        out[:d] = _decode(q[:d], k_src[:, idx], v_src[:, idx], meta.decode_bias, num_heads, num_kv_heads,
                          head_dim, scale)
    if meta.num_prefills:
        grid = q.new_zeros(meta.num_prefills * meta.max_query_len, num_heads, head_dim)
        grid[meta.prefill_q_idx] = q[d:]
        grid = grid.view(meta.num_prefills, meta.max_query_len, num_heads, head_dim)
        idx = meta.prefill_kv_idx
        o = _prefill(grid, k_src[:, idx], v_src[:, idx], meta.prefill_mask, num_kv_heads != num_heads, scale)
        out[d:] = o.reshape(-1, num_heads, head_dim)[meta.prefill_q_idx]
    return out.view(n, num_heads * head_dim)


@torch.library.custom_op("runner_core::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                       num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """`paged_attention` as one opaque op, so a compiled graph neither traces nor breaks on it. Its
    schema declares that it writes `kv_cache` (the step's K/V go into the pool), so compiled and
    AOTInductor graphs know the pool they take as an input changes under them."""
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
