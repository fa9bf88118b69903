"""The gather attention backend (`attention_backend="gather"`, and every stateless forward): each
sequence's keys and values are copied out of the pool (or, with no pool, out of the step's own
tokens) through gather indices, then attended with matmuls (decodes) and SDPA (prefill chunks).

Decodes (one query each) read keys 0..L-1 through `decode_kv_idx` [D, L] under an additive bias that
hides the keys past each context; prefill chunks are scattered into a padded [P, max_query_len]
grid by `prefill_q_idx` and read their keys through `prefill_kv_idx` [P, L_p] under a boolean mask
(None for fresh prompts: SDPA's causal kernel is exact for them). The builder makes every field once
per step, with tensor operations, and every layer shares them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner_core.layers.attention import AttentionMetadataBuilder, CommonAttentionMetadata


@dataclass
class GatherMetadata:
    """The gather backend's per-step inputs, shared by every layer."""

    slot_mapping: torch.Tensor | None  # [N] pool slot of each token, None when there is no KV pool
    num_decode_tokens: int
    decode_kv_idx: torch.Tensor | None  # [D, L_d] the pool slot (or step token) of each decode's j-th key
    decode_bias: torch.Tensor | None  # [1, D, 1, L_d] additive: 0 where visible, -inf elsewhere
    num_prefills: int
    max_query_len: int
    prefill_q_idx: torch.Tensor | None  # [N - D] position of each prefill token in the padded grid
    prefill_kv_idx: torch.Tensor | None  # [P, L_p]
    prefill_mask: torch.Tensor | None  # [P, 1, max_query_len, L_p] True where visible; None: plain causal

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, H, Dh]; k, v: [KVH, slots, Dh] (the pool, or the step's own tokens) -> [N, H, Dh]."""
        num_heads, num_kv_heads = q.shape[1], k.shape[0]
        out = torch.empty_like(q)
        d = self.num_decode_tokens
        if d:
            idx = self.decode_kv_idx
            out[:d] = decode_attention(q[:d], k[:, idx], v[:, idx], self.decode_bias, num_kv_heads, scale)
        if self.num_prefills:
            grid = q.new_zeros(self.num_prefills * self.max_query_len, num_heads, q.shape[2])
            grid[self.prefill_q_idx] = q[d:]
            grid = grid.view(self.num_prefills, self.max_query_len, num_heads, q.shape[2])
            idx = self.prefill_kv_idx
            o = _prefill(grid, k[:, idx], v[:, idx], self.prefill_mask, num_kv_heads != num_heads, scale)
            out[d:] = o.reshape(-1, num_heads, q.shape[2])[self.prefill_q_idx]
        return out


class GatherMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> GatherMetadata:
        """Gather indices over the pool through the block tables (or, without a pool, over the step's
        own tokens), the decodes' bias and the prefills' grid and mask. With `common.decode_len`
        the decodes' key length is fixed (masked past each context): one shape per batch size."""
        start_t, qlen_t, positions, bt = common.starts, common.query_lens, common.positions, common.block_tables
        block_size, window = common.block_size, common.sliding_window
        n = int(qlen_t.sum())
        cu = torch.cumsum(qlen_t, 0) - qlen_t  # flat offset of each sequence
        d, p = common.num_decodes, len(start_t) - common.num_decodes
        meta = GatherMetadata(slot_mapping=common.slot_mapping, num_decode_tokens=d, decode_kv_idx=None,
                              decode_bias=None, num_prefills=p, max_query_len=0, prefill_q_idx=None,
                              prefill_kv_idx=None, prefill_mask=None)
        if d:
            length = common.decode_len or int(start_t[:d].max()) + 1
            meta.decode_kv_idx = _kv_gather(None if bt is None else bt[:d], None if bt is not None else cu[:d],
                                            length, block_size, n)
            visible = _visible(start_t[:d], length, window)
            meta.decode_bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[None, :, None, :]
        if p:
            p_start, p_len = start_t[d:], qlen_t[d:]
            max_q = int(p_len.max())
            key_len = int((p_start + p_len).max())
            meta.max_query_len = max_q
            row = torch.repeat_interleave(torch.arange(p), p_len)
            meta.prefill_q_idx = row * max_q + positions[d:] - torch.repeat_interleave(p_start, p_len)
            meta.prefill_kv_idx = _kv_gather(None if bt is None else bt[d:], None if bt is not None else cu[d:],
                                             key_len, block_size, n)
            if int(p_start.max()) > 0 or (window is not None and window < key_len):
                q_pos = p_start.unsqueeze(1) + torch.arange(max_q)
                meta.prefill_mask = _visible(q_pos, key_len, window).unsqueeze(1)
            # else fresh prompts, right-padded: plain causal attention is exact for every real query
            # (padded keys sit after the last real query), and lets SDPA skip the upper triangle
        return meta


def _kv_gather(block_tables: torch.Tensor | None, base: torch.Tensor | None, length: int, block_size: int,
               num_tokens: int):
    """[B, length] gather index of keys 0..length-1: pool slots via block tables, or base + j
    into the step's own tokens (clamped: positions past a sequence's end are masked anyway)."""
    j = torch.arange(length)
    if block_tables is None:
        return (base.unsqueeze(1) + j).clamp_(max=num_tokens - 1)
    blocks = block_tables.gather(1, (j // block_size).expand(block_tables.shape[0], -1))
    return blocks * block_size + j % block_size


def _visible(q_pos: torch.Tensor, key_len: int, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: key j visible from a query at position p iff j <= p (and p - j < w)."""
    j = torch.arange(key_len)
    mask = j <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        mask &= q_pos.unsqueeze(-1) - j < sliding_window
    return mask


def decode_attention(q, k, v, bias, num_kv_heads: int, scale: float) -> torch.Tensor:
    """One query per sequence. q: [D, H, Dh]; k, v: [KVH, D, L, Dh] (as gathered); bias: [1, D, 1, L].

    Grouped heads fold into the query dimension, so each KV head is read once and no repeat
    of K/V is needed: two batched matmuls over (KVH, D)."""
    d, num_heads, head_dim = q.shape
    qg = q.view(d, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [KVH, D, G, Dh]
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(bias)  # [KVH, D, G, L]
    out = torch.matmul(scores.softmax(dim=-1), v)  # [KVH, D, G, Dh]
    return out.transpose(0, 1).reshape(d, num_heads, head_dim)


def _prefill(q, k, v, mask, gqa: bool, scale: float) -> torch.Tensor:
    """q: [P, Lq, H, Dh]; k, v: [KVH, P, Lk, Dh]; mask: [P, 1, Lq, Lk] or None (causal) -> [P, Lq, H, Dh]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)
