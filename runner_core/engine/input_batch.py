"""The step's input side: what a step is (`StepBatch`, rank 0's scheduled work as plain lists, what a
parallel runner broadcasts to every rank) and the persistent tensors it is written into on every rank
(`InputBuffers`: token ids, positions, slot mapping and block tables, allocated once, filled in place
through numpy views). ForwardPass (forward_pass.py) turns the filled buffers into the model's input.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from runner_core.layers.attention import CommonAttentionMetadata

if TYPE_CHECKING:
    from runner_core.engine.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    """One step's scheduled work as plain lists, decodes (one new token) first: what `prepare` reads
    (and, in a parallel runner, what rank 0 broadcasts to every rank)."""

    starts: list[int]  # first new position of each sequence (the tokens before it are in the KV pool)
    num_new_tokens: list[int]
    token_ids: list[int]  # the new tokens of every sequence, concatenated
    block_tables: list[list[int]]
    num_decodes: int
    sample_rows: list[int]  # sequences whose prompt is complete after this step: they sample a token
    # image tokens in the step: (flat index of the first, image hash, its first feature row, rows, pixels)
    images: list[tuple[int, str, int, int, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def build(cls, scheduled: Seq[tuple[Sequence, int]]) -> tuple[StepBatch, list[Sequence]]:
        """The batch of (sequence, new tokens) pairs, and the sequences in the batch's order."""
        ordered = [x for x in scheduled if x[1] == 1] + [x for x in scheduled if x[1] > 1]
        starts = [s.num_computed_tokens for s, _ in ordered]
        counts = [n for _, n in ordered]
        ids = list(chain.from_iterable(s.token_ids[st:st + n] for (s, n), st in zip(ordered, starts)))
        sample = [i for i, (s, n) in enumerate(ordered) if s.num_computed_tokens + n == s.num_tokens]
        images, base = [], 0
        for (seq, n), start in zip(ordered, starts):
            for item in seq.mm_items:
                part = item.overlap(start, start + n)
                if part is not None:
                    images.append((base + part[0] - start, item.hash, part[0] - item.offset, part[1] - part[0],
                                   item.pixel_values))
            base += n
        batch = cls(starts=starts, num_new_tokens=counts, token_ids=ids,
                    block_tables=[s.block_table for s, _ in ordered], num_decodes=sum(1 for n in counts if n == 1),
                    sample_rows=sample, images=images)
        return batch, [s for s, _ in ordered]

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.token_ids) - self.num_decodes


class InputBuffers:
    """Persistent per-step input buffers: token ids, positions, slot mapping, block tables.

    Allocated once at their maximum size (max_num_batched_tokens tokens, max_num_seqs rows of
    max_model_len / block_size blocks) and filled in place every step through numpy views, so a
    step hands the model slices of the same tensors instead of fresh allocations. On CUDA the
    filled slices are copied into device twins that also never move (what graph capture needs)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        pin = device.type == "cuda"
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.cpu = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin),
            "positions": torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin),
            "slot_mapping": torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin),
            "block_tables": torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.long, pin_memory=pin),
        }
        self.np = {name: t.numpy() for name, t in self.cpu.items()}
        self.device_bufs = ({name: torch.zeros_like(t, device=device) for name, t in self.cpu.items()}
                            if device.type != "cpu" else self.cpu)

    def fill(self, ids: list[int], starts: list[int], q_lens: list[int], num_decodes: int,
             block_tables: list[list[int]], block_size: int, sliding_window: int | None, *,
             decode_len: int | None = None, num_pool_blocks: int = 0) -> CommonAttentionMetadata:
        """Write one step over the pool (token ids, positions, block tables, slot mapping) and return
        its common metadata, whose tensors are views of these buffers: block tables [S, W], W the
        longest table's blocks, or every column with `decode_len` (a static-length decode reads them
        all), zeros past each table."""
        n, b = len(ids), len(starts)
        width = max(map(len, block_tables))
        if n > self.max_tokens or b > self.max_seqs or width > self.max_blocks:
            raise ValueError(f"step of {n} tokens / {b} sequences / {width} blocks exceeds the input buffers "
                             f"({self.max_tokens} / {self.max_seqs} / {self.max_blocks})")
        ids_np, pos_np, slot_np = self.np["input_ids"][:n], self.np["positions"][:n], self.np["slot_mapping"][:n]
        if decode_len is not None:
            width = self.max_blocks
        self.np["block_tables"][:b, :width] = 0
        bt_np = self.np["block_tables"][:b, :width]
        ids_np[:] = ids
        start_np, qlen_np = np.asarray(starts), np.asarray(q_lens)
        offsets = np.cumsum(qlen_np) - qlen_np
        np.subtract(np.arange(n), np.repeat(offsets - start_np, qlen_np), out=pos_np)
        for row, table in enumerate(block_tables):
            bt_np[row, : len(table)] = table
        rows = np.repeat(np.arange(b), qlen_np)
        np.add(bt_np[rows, pos_np // block_size] * block_size, pos_np % block_size, out=slot_np)
        return CommonAttentionMetadata(
            starts=torch.from_numpy(start_np), query_lens=torch.from_numpy(qlen_np), num_decodes=num_decodes,
            positions=self.cpu["positions"][:n], block_size=block_size, sliding_window=sliding_window,
            slot_mapping=self.cpu["slot_mapping"][:n], block_tables=self.cpu["block_tables"][:b, :width],
            decode_len=decode_len, num_pool_blocks=num_pool_blocks)

    def to_device(self, name: str, view: torch.Tensor) -> torch.Tensor:
        """The device twin's slice holding `view` (the same tensor on the CPU)."""
        if self.device_bufs is self.cpu:
            return view
        target = self.device_bufs[name][tuple(slice(0, s) for s in view.shape)]
        target.copy_(view, non_blocking=True)
        return target
