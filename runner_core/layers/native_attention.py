"""The native attention backend (`attention_backend="native"`, the CPU default where the kernels
build): one C++ kernel (kernels/, `native_paged_attention`) runs every query row, decode or prefill,
over its sequence's keys read in place in the pool through the block tables; no gather, no mask
tensor (the kernel bounds each row's keys by its context length and the sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner_core.kernels import native_paged_attention
from runner_core.layers.attention import AttentionMetadataBuilder, CommonAttentionMetadata


@dataclass
class NativeMetadata:
    """The native kernel's per-step inputs, shared by every layer."""

    slot_mapping: torch.Tensor  # [N] pool slot of each token
    block_tables: torch.Tensor  # [S, W] each sequence's blocks
    row_seq: torch.Tensor  # [N] each token's sequence (its row of the block tables)
    context_lens: torch.Tensor  # [N] keys 0..len-1 of its sequence: its position + 1
    block_size: int
    sliding_window: int | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, H, Dh]; k, v: [KVH, slots, Dh], the layer's pool with the step's K/V written -> [N, H, Dh]."""
        out = torch.empty_like(q)
        native_paged_attention(out, q, k, v, self.block_tables, self.row_seq, self.context_lens, self.block_size,
                               scale, self.sliding_window)
        return out


class NativeMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> NativeMetadata:
        """Every row attends to its sequence's keys 0..position."""
        qlen_t = common.query_lens
        return NativeMetadata(slot_mapping=common.slot_mapping, block_tables=common.block_tables,
                              row_seq=torch.repeat_interleave(torch.arange(len(qlen_t)), qlen_t),
                              context_lens=common.positions + 1, block_size=common.block_size,
                              sliding_window=common.sliding_window)
