"""FlexAttention over the KV pool in place: the attention backend for CUDA (`attention_backend="flex"`).

The step's queries become one padded sequence of query blocks of Q_BLOCK rows, each block holding
the tokens of one sequence only (a decode fills one row of its block; a prefill chunk of n tokens
takes ceil(n / Q_BLOCK) blocks). The layer's pool `[2, KVH, slots, Dh]` is the key/value sequence
as it is: no gathered copy. Two things describe the mask:

* `mask_mod` is the whole truth: a query row knows its sequence and position; a physical slot
  knows its block, the block its logical index (`logical_of`, from the step's block tables) and
  the slot its position; the query sees the slot iff the sequence owns that block at that logical
  index (its block table says so) and the position is causal (and inside the sliding window).
* the BlockMask only skips work: query block b visits the KV blocks its sequence's block table
  lists, from the window's first block to the block of b's last position (the flex KV block is
  the pool's block), and those all of b's queries see whole are "full" (mask_mod not evaluated).
  Eager flex_attention evaluates `mask_mod` densely and ignores the sparsity; the compiled kernels
  (Triton on CUDA, the C++ template on the CPU) visit only the listed blocks.

`FlexMetadataBuilder` makes the metadata on the CPU with tensor operations once per step (`build`) and
completes it on the device (`finish`: the physical-to-logical map); every layer shares it. On the CPU
this backend is for tests: eager, it scores every query against the whole pool (slow).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from runner_core.layers.attention import AttentionMetadataBuilder, CommonAttentionMetadata

Q_BLOCK = 16  # query rows per flex query block (Triton's smallest tile for tensor-core dots)


@dataclass
class FlexMetadata:
    """The flex backend's per-step inputs, shared by every layer; R padded rows in QB = R / Q_BLOCK
    query blocks, W block-table columns."""

    slot_mapping: torch.Tensor  # [N] pool slot of each token
    q_rows: torch.Tensor  # [N] padded row of each flat token
    row_seq: torch.Tensor  # [R] sequence of each row
    row_pos: torch.Tensor  # [R] position of each row (-1: a pad row, masked entirely)
    kv_num_blocks: torch.Tensor  # [1, 1, QB] the BlockMask's partial blocks per query block (mask_mod applies)
    kv_indices: torch.Tensor  # [1, 1, QB, W]
    full_kv_num_blocks: torch.Tensor  # [1, 1, QB] its full ones (every query sees every key)
    full_kv_indices: torch.Tensor  # [1, 1, QB, W]
    block_tables: torch.Tensor  # [S, W] rows zero-padded past each sequence's blocks
    num_blocks: torch.Tensor  # [S] blocks each sequence's keys fill, so far
    block_size: int
    sliding_window: int | None
    logical_of: torch.Tensor | None = None  # [pool blocks + 1], made on the device (`finish`)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, H, Dh]; k, v: [KVH, slots, Dh], the layer's pool with the step's K/V written -> [N, H, Dh]."""
        return flex_paged_attention(q, k, v, self, scale)


class FlexMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlexMetadata:
        """The per-step flex metadata (CPU tensors) over the step's block tables; `finish` completes it."""
        starts, q_lens, block_tables = common.starts, common.query_lens, common.block_tables
        block_size, sliding_window = common.block_size, common.sliding_window
        num_seqs, width = block_tables.shape
        seq_ids = torch.arange(num_seqs)
        q_blocks = (q_lens + Q_BLOCK - 1) // Q_BLOCK
        block_off = torch.cumsum(q_blocks, 0) - q_blocks  # first query block of each sequence
        tok_off = torch.cumsum(q_lens, 0) - q_lens
        tok_seq = torch.repeat_interleave(seq_ids, q_lens)
        in_seq = torch.arange(int(q_lens.sum())) - tok_off[tok_seq]
        q_rows = block_off[tok_seq] * Q_BLOCK + in_seq
        num_rows = int(q_blocks.sum()) * Q_BLOCK
        row_seq = torch.repeat_interleave(seq_ids, q_blocks * Q_BLOCK)
        row_pos = torch.full((num_rows,), -1, dtype=torch.long)
        row_pos[q_rows] = starts[tok_seq] + in_seq
        # query block b of sequence s holds positions first..last: it visits the logical blocks from the
        # window's start to last's; those every one of its queries sees whole are "full" (no mask_mod)
        qb_seq = torch.repeat_interleave(seq_ids, q_blocks)
        first = (starts[qb_seq] + (torch.arange(len(qb_seq)) - block_off[qb_seq]) * Q_BLOCK).unsqueeze(1)
        last = torch.minimum(first + Q_BLOCK, (starts + q_lens)[qb_seq].unsqueeze(1)) - 1
        key_first = torch.arange(width) * block_size  # [W] first position of each logical block
        visited = key_first <= last
        full = key_first + block_size - 1 <= first
        if sliding_window is not None:
            visited &= key_first + block_size - 1 > first - sliding_window
            full &= key_first > last - sliding_window
        partial_num, partial = _listed(block_tables, qb_seq, visited & ~full)
        full_num, full = _listed(block_tables, qb_seq, full)
        return FlexMetadata(slot_mapping=common.slot_mapping, q_rows=q_rows, row_seq=row_seq, row_pos=row_pos,
                            kv_num_blocks=partial_num, kv_indices=partial, full_kv_num_blocks=full_num,
                            full_kv_indices=full, block_tables=block_tables,
                            num_blocks=(starts + q_lens + block_size - 1) // block_size, block_size=block_size,
                            sliding_window=sliding_window)

    def finish(self, meta: FlexMetadata, common: CommonAttentionMetadata) -> None:
        """On the metadata's device, once per step: `logical_of` [pool blocks + 1], the logical
        index of each physical block in the step's block tables (-1: none; a block shared through the
        prefix cache sits at the same index in every table). On the CPU, the BlockMask's rows are
        widened to the whole pool, which the C++ template requires (the Triton kernel reads only the
        first kv_num_blocks of a row, so CUDA keeps them one block table wide)."""
        num_pool_blocks, tables = common.num_pool_blocks, meta.block_tables
        width = tables.shape[1]
        cols = torch.arange(width, device=tables.device).expand_as(tables)
        owned = cols < meta.num_blocks.unsqueeze(1)
        targets = torch.where(owned, tables, num_pool_blocks)  # padding columns land on the spare entry
        logical = torch.full((num_pool_blocks + 1,), -1, dtype=torch.long, device=tables.device)
        meta.logical_of = logical.scatter_(0, targets.flatten(), cols.flatten())
        if tables.device.type == "cpu" and width < num_pool_blocks:
            pad = (0, num_pool_blocks - width)
            meta.kv_indices = torch.nn.functional.pad(meta.kv_indices, pad)
            meta.full_kv_indices = torch.nn.functional.pad(meta.full_kv_indices, pad)


def _listed(block_tables: torch.Tensor, qb_seq: torch.Tensor, chosen: torch.Tensor):
    """A BlockMask's (counts [1, 1, QB], indices [1, 1, QB, W]) int32: for query block b, the physical
    blocks of the logical blocks `chosen[b]` of its sequence, in logical order, first."""
    width = chosen.shape[1]
    cols = torch.arange(width)
    order = torch.where(chosen, cols, cols + width).argsort(dim=1)  # chosen columns first, in order
    indices = block_tables[qb_seq.unsqueeze(1), order]
    return chosen.sum(1).to(torch.int32)[None, None], indices.to(torch.int32)[None, None]


def _mask_mod(row_seq, row_pos, logical_of, block_tables, block_size: int, sliding_window: int | None):
    def mask(b, h, q_idx, kv_idx):
        seq, q_pos = row_seq[q_idx], row_pos[q_idx]
        block = kv_idx // block_size
        logical = logical_of[block]
        owned = (logical >= 0) & (block_tables[seq, logical.clamp(min=0)] == block)
        kv_pos = logical * block_size + kv_idx % block_size
        visible = owned & (kv_pos <= q_pos)
        if sliding_window is not None:
            visible = visible & (q_pos - kv_pos < sliding_window)
        return visible

    return mask


@functools.cache
def _compiled_flex(device_type: str):
    # on the CPU (tests only) one program per shape: with dynamic shapes inductor's C++ flex template
    # fails to compile in torch 2.13 ("'cur_kvSplitSize9' was not declared in this scope")
    return torch.compile(flex_attention, fullgraph=True, dynamic=False if device_type == "cpu" else None)


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: FlexMetadata,
                         scale: float, compiled: bool | None = None) -> torch.Tensor:
    """q: [N, H, Dh] (the step's tokens); k_cache, v_cache: [KVH, slots, Dh], the layer's pool with
    the step's K/V already written -> [N, H, Dh]. `compiled`: run the compiled kernel (default: on
    CUDA, where eager flex would score every query against the whole pool)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, rows = meta.block_size, meta.row_seq.shape[0]
    grid = q.new_zeros(rows, num_heads, head_dim)
    grid[meta.q_rows] = q
    mask_mod = _mask_mod(meta.row_seq, meta.row_pos, meta.logical_of, meta.block_tables, block_size,
                         meta.sliding_window)
    block_mask = BlockMask.from_kv_blocks(meta.kv_num_blocks, meta.kv_indices, meta.full_kv_num_blocks,
                                          meta.full_kv_indices,
                                          BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
                                          seq_lengths=(rows, k_cache.shape[1]), compute_q_blocks=False)
    if compiled is None:
        compiled = q.is_cuda
    options = None
    if q.is_cuda:  # the main Triton kernel (not flex decoding), its tiles dividing the flex blocks
        options = {"BACKEND": "TRITON", "BLOCK_M": Q_BLOCK, "BLOCK_N": min(block_size, 64)}
    fn = _compiled_flex(q.device.type) if compiled else flex_attention
    out = fn(grid.transpose(0, 1).unsqueeze(0), k_cache.unsqueeze(0), v_cache.unsqueeze(0), block_mask=block_mask,
             scale=scale, enable_gqa=k_cache.shape[0] != num_heads, kernel_options=options)
    return out[0].transpose(0, 1)[meta.q_rows]
