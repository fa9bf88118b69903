"""The step's input side: what a step is (`StepBatch`, rank 0's scheduled work as plain lists, what a
parallel runner broadcasts to every rank) and what every rank writes it into: its `BlockTable`, kept
across steps and sent only the block ids it lacks (vLLM's worker BlockTable), and its `InputBuffers`,
the step's tensors (token ids, positions, slot mapping, block tables) allocated once and filled in
place through numpy views. ForwardPass (forward_pass.py) turns the filled buffers into the model's input.

Block tables change little from step to step (a decode adds a block every block_size tokens), so rank 0
sends each sequence's new entries (`StepBatch.new_blocks`, from `Sequence.num_sent_blocks` on, a
sequence's whole table when it is admitted or readmitted) and the requests whose blocks were freed
since the previous batch (`StepBatch.freed`); a defragmentation renumbers the rows where they are
(`BlockTable.move`). Rewriting an entry with the same id is harmless, so a step that failed before
every rank took its batch is made good by sending the same entries again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
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

    request_ids: list[str]  # each sequence's request: its row of every rank's BlockTable
    starts: list[int]  # first new position of each sequence (the tokens before it are in the KV pool)
    num_new_tokens: list[int]
    token_ids: list[int]  # the new tokens of every sequence, concatenated
    num_decodes: int
    # sequences whose prompt is complete after this step: they sample a token (a parallel-sampling parent's row
    # once per sequence it forks into: engine/parallel_sampling.py)
    sample_rows: list[int]
    # prompt positions whose logits are wanted too (prompt logprobs): (row, first position, count); each
    # position's logits give the logprob of the prompt token after it
    prompt_logits: list[tuple[int, int, int]] = field(default_factory=list)
    # block-table entries the ranks lack: (request id, index of the first, block ids), in the batch's order
    new_blocks: list[tuple[str, int, list[int]]] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)  # requests freed since the last batch: their rows go first
    # (source, destination) KV blocks each rank copies before the forward (copy on write of a forked block)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # image tokens in the step: (flat index of the first, image hash, its first feature row, rows, pixels)
    images: list[tuple[int, str, int, int, torch.Tensor]] = field(default_factory=list)
    # speculative decoding: (row, drafts) of each decode carrying drafts, whose logits rows follow the sampling
    # rows' (one per draft: the positions before its last, which scores its bonus token) and precede prompt_logits
    spec_rows: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def build(cls, scheduled: Seq[tuple[Sequence, int]], freed: Iterable[str] = (),
              block_copies: Seq[tuple[int, int]] = (), spec: bool = False) -> tuple[StepBatch, list[Sequence]]:
        """The batch of (sequence, new tokens) pairs, and the sequences in the batch's order; `freed`:
        the requests whose blocks were freed since the last batch (finished, aborted, preempted);
        `block_copies`: the scheduler's copies on write (MemoryManager.take_copies); `spec`: speculation is
        on, a decode's new tokens are its last token then its drafts (`Sequence.spec_token_ids`)."""
        ordered = [x for x in scheduled if x[1] == 1] + [x for x in scheduled if x[1] > 1]
        starts = [s.num_computed_tokens for s, _ in ordered]
        counts = [n for _, n in ordered]
        spec_rows = []
        if spec:
            ids, sample, spec_rows = _with_drafts(ordered, starts)
        else:
            ids = list(chain.from_iterable(s.token_ids[st:st + n] for (s, n), st in zip(ordered, starts)))
            sample = [i for i, (s, n) in enumerate(ordered) if s.num_computed_tokens + n == s.num_tokens
                      for _ in range(s.fork_into)]
        prompt_logits = []
        for i, ((s, n), st) in enumerate(zip(ordered, starts)):
            if s.prompt_logprobs_pending:  # the positions not yet done, up to the one before the prompt's last
                first, end = max(st, len(s.prompt_logprobs) - 1), min(st + n, s.num_prompt_tokens - 1)
                if end > first:
                    prompt_logits.append((i, first, end - first))
        new_blocks = [(s.request_id, s.num_sent_blocks, s.block_table[s.num_sent_blocks:]) for s, _ in ordered
                      if len(s.block_table) > s.num_sent_blocks]
        images, base = [], 0
        for (seq, n), start in zip(ordered, starts):
            for item in seq.mm_items:
                part = item.overlap(start, start + n)
                if part is not None:
                    images.append((base + part[0] - start, item.hash, part[0] - item.offset, part[1] - part[0],
                                   item.pixel_values))
            base += n
        batch = cls(request_ids=[s.request_id for s, _ in ordered], starts=starts, num_new_tokens=counts,
                    token_ids=ids, num_decodes=sum(1 for n in counts if n == 1), sample_rows=sample,
                    prompt_logits=prompt_logits,
                    new_blocks=new_blocks, freed=list(freed), block_copies=list(block_copies), images=images,
                    spec_rows=spec_rows)
        return batch, [s for s, _ in ordered]

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.token_ids) - self.num_decodes

    @property
    def num_spec_tokens(self) -> int:
        """The drafts the step verifies."""
        return sum(d for _, d in self.spec_rows)

    @property
    def num_logits(self) -> int:
        """Rows of the step's logits: one per sampling sequence, one per draft, one per prompt-logprob position."""
        return len(self.sample_rows) + self.num_spec_tokens + sum(c for _, _, c in self.prompt_logits)


def _with_drafts(ordered: list[tuple[Sequence, int]], starts: list[int]):
    """(token ids, sampling rows, spec rows) of a batch whose decodes may carry drafts: such a row's tokens are
    its last token then its drafts, and it samples (its drafts verified, its last position giving the bonus)."""
    ids, sample, spec_rows = [], [], []
    for i, ((s, n), st) in enumerate(zip(ordered, starts)):
        drafts = s.spec_token_ids
        ids += s.token_ids[st:st + n - len(drafts)]
        ids += drafts
        if drafts:
            spec_rows.append((i, len(drafts)))
        if s.num_computed_tokens + n - len(drafts) == s.num_tokens:
            sample += [i] * s.fork_into
    return ids, sample, spec_rows


class BlockTable:
    """Every rank's block tables, kept across steps: one row per request with blocks (`rows`) in one
    array [rows, max_blocks], zeros past each table (`num_blocks`); row 0 stays all zeros (block 0, for
    dummy steps). A step brings the entries the rows lack and the requests whose rows go (`update`)."""

    ZERO_ROW = 0

    def __init__(self, max_rows: int, max_blocks: int):
        self.table = np.zeros((max_rows + 1, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_rows + 1, dtype=np.int64)
        self.rows: dict[Hashable, int] = {}  # request id -> its row
        self._free = list(range(max_rows, 0, -1))

    def update(self, freed: Iterable[Hashable], new_blocks: Iterable[tuple[Hashable, int, list[int]]],
               request_ids: Iterable[Hashable] = ()) -> list[int]:
        """Drop the rows of `freed` (unknown ids are ignored), then write each (request id, first index,
        block ids) there, a row made for a request without one (a write starting at 0 cuts the row
        where it ends: a readmitted request's new table); returns the rows of `request_ids`."""
        for rid in freed:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.table[row, : self.num_blocks[row]] = 0
                self.num_blocks[row] = 0
                self._free.append(row)
        for rid, first, ids in new_blocks:
            row = self.rows.get(rid)
            held = 0 if row is None else int(self.num_blocks[row])
            if first > held:
                raise RuntimeError(f"request {rid!r} has {held} block-table entries on this rank, yet its entries "
                                   f"from {first} on came: the ranks' block tables went out of step with rank 0's")
            if row is None:
                row = self.rows[rid] = self._free.pop() if self._free else self._grow()
            end = first + len(ids)
            if end > self.table.shape[1]:
                raise ValueError(f"request {rid!r} has {end} KV blocks; its block table holds {self.table.shape[1]}")
            self.table[row, first:end] = ids
            if first == 0 and end < held:
                self.table[row, end:held] = 0
                held = end
            self.num_blocks[row] = max(end, held)
        try:
            return [self.rows[rid] for rid in request_ids]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]!r} has no block table on this rank: its blocks were never "
                               "sent (StepBatch.new_blocks)") from None

    def _grow(self) -> int:
        """Room for more rows than planned (the scheduler keeps at most max_num_seqs; this is a guard)."""
        n = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free = list(range(2 * n - 1, n, -1))
        return n

    def move(self, moves: dict[int, int]) -> None:
        """Renumber block ids as a defragmentation moved them ({old id: new id}; block 0 never moves,
        so the zeros past each table stay zeros)."""
        if not moves:
            return
        lookup = np.arange(max(int(self.table.max()), *moves) + 1)
        lookup[list(moves)] = list(moves.values())
        self.table = lookup[self.table]


class InputBuffers:
    """Persistent per-step input buffers: token ids, positions, slot mapping, block tables, and the
    rank's BlockTable they take each step's block tables from.

    Allocated once at their maximum size (max_num_batched_tokens tokens, max_num_seqs rows of
    max_model_len / block_size blocks) and filled in place every step through numpy views, so a
    step hands the model slices of the same tensors instead of fresh allocations. On CUDA the
    filled slices are copied into device twins that also never move (what graph capture needs)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        pin = device.type == "cuda"
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.block_table = BlockTable(max_seqs, max_blocks_per_seq)
        self.cpu = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin),
            "positions": torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin),
            "slot_mapping": torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin),
            "block_tables": torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.long, pin_memory=pin),
        }
        self.np = {name: t.numpy() for name, t in self.cpu.items()}
        self.device_bufs = ({name: torch.zeros_like(t, device=device) for name, t in self.cpu.items()}
                            if device.type != "cpu" else self.cpu)

    def fill(self, ids: list[int], starts: list[int], q_lens: list[int], num_decodes: int, rows: list[int],
             block_size: int, sliding_window: int | None, *, decode_len: int | None = None,
             num_pool_blocks: int = 0) -> CommonAttentionMetadata:
        """Write one step over the pool (token ids, positions, block tables: each sequence's row of
        `block_table`, slot mapping) and return its common metadata, whose tensors are views of these
        buffers: block tables [S, W], W the longest table's blocks, or every column with `decode_len`
        (a static-length decode reads them all), zeros past each table."""
        n, b = len(ids), len(starts)
        rows_np = np.asarray(rows)
        width = self.max_blocks if decode_len is not None else int(self.block_table.num_blocks[rows_np].max())
        if n > self.max_tokens or b > self.max_seqs:
            raise ValueError(f"step of {n} tokens / {b} sequences exceeds the input buffers "
                             f"({self.max_tokens} / {self.max_seqs})")
        ids_np, pos_np, slot_np = self.np["input_ids"][:n], self.np["positions"][:n], self.np["slot_mapping"][:n]
        bt_np = self.np["block_tables"][:b, :width]
        np.take(self.block_table.table[:, :width], rows_np, axis=0, out=bt_np)
        ids_np[:] = ids
        start_np, qlen_np = np.asarray(starts), np.asarray(q_lens)
        offsets = np.cumsum(qlen_np) - qlen_np
        np.subtract(np.arange(n), np.repeat(offsets - start_np, qlen_np), out=pos_np)
        token_rows = np.repeat(np.arange(b), qlen_np)
        np.add(bt_np[token_rows, pos_np // block_size] * block_size, pos_np % block_size, out=slot_np)
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
