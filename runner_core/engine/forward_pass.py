"""ForwardPass: turns a step's batch into flat tensors once per step and runs the model.

Layout: decode sequences (one new token) first, then prefill chunks. A `StepBatch` says, per
sequence, where its new tokens start, how many there are, those tokens and its block table;
everything the attention layers need (slot mapping, gather indices, masks) is derived from it
with tensor operations, into buffers allocated once (`InputBuffers`); no per-token loops. Every
rank of a parallel runner prepares the same batch over its own KV shard. The metadata follows the
attention backend (`resolve_attention_backend`): flex, the native CPU kernel, or gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from runner_core.engine.input_batch import InputBuffers, StepBatch
from runner_core.layers.attention import (
    Attention,
    AttentionMetadata,
    resolve_attention_backend,
    set_forward_context,
)
from runner_core.layers.flex_attention import build_flex_fields, finish_flex_fields


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] flat index of the last token of each sampling sequence
    num_prefill_tokens: int
    num_decode_tokens: int
    num_pad_tokens: int = 0  # rows added to reach a decode program's size (repeats of the first row)
    multimodal: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat positions, image features) to merge


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


def build_metadata(starts: list[int], q_lens: list[int], num_decodes: int, block_size: int,
                   sliding_window: int | None, decode_kernel: bool = False,
                   filled: dict[str, torch.Tensor] | None = None,
                   decode_len: int | None = None, flex: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [N] and attention metadata for sequences whose first `num_decodes` have one query token.

    `filled` holds the positions, slot mapping and block tables InputBuffers wrote for a step
    over the KV pool; without it there is no pool and keys come from the step's own tokens
    (stateless forward). With `decode_kernel` (and `filled`), every row carries its sequence and
    context length for the native kernel, which reads the pool in place (no gather indices).
    `decode_len` fixes the decodes' key length (masked past each context) so their metadata has one
    shape per batch size (CUDA graphs).
    With `flex` (and `filled`), every token's attention is FlexAttention over the pool in place
    (flex_attention.py); ForwardPass finishes its metadata on the device.
    """
    start_t, qlen_t = torch.tensor(starts), torch.tensor(q_lens)
    n = int(qlen_t.sum())
    cu = torch.cumsum(qlen_t, 0) - qlen_t  # flat offset of each sequence
    if filled is not None:
        positions, slot_mapping, bt = filled["positions"], filled["slot_mapping"], filled["block_tables"]
    else:
        positions = torch.arange(n) - torch.repeat_interleave(cu - start_t, qlen_t)
        slot_mapping = bt = None
    d, p = num_decodes, len(starts) - num_decodes
    meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=d, decode_kv_idx=None, decode_bias=None,
                             num_prefills=p, max_query_len=0, prefill_q_idx=None, prefill_kv_idx=None,
                             prefill_mask=None, block_size=block_size, sliding_window=sliding_window)
    if flex and filled is not None:
        tables = filled["block_tables_full"] if decode_len else bt
        for name, value in build_flex_fields(start_t, qlen_t, tables, block_size, sliding_window).items():
            setattr(meta, name, value)
        return positions, meta
    if decode_kernel and filled is not None:
        # the native kernel: every row (decode or prefill) attends to its sequence's keys 0..position
        meta.native_block_tables, meta.native_context_lens = bt, positions[:n] + 1
        meta.native_row_seq = torch.repeat_interleave(torch.arange(len(starts)), qlen_t)
        return positions, meta
    if d:
        length = decode_len or int(start_t[:d].max()) + 1
        if decode_len:
            bt = filled["block_tables_full"]
        meta.decode_kv_idx = _kv_gather(None if bt is None else bt[:d], None if bt is not None else cu[:d],
                                        length, block_size, n)
        visible = _visible(start_t[:d], length, sliding_window)
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
        if int(p_start.max()) == 0 and (sliding_window is None or sliding_window >= key_len):
            # fresh prompts, right-padded: plain causal attention is exact for every real query
            # (padded keys sit after the last real query), and lets SDPA skip the upper triangle
            meta.prefill_mask = None
        else:
            q_pos = p_start.unsqueeze(1) + torch.arange(max_q)
            meta.prefill_mask = _visible(q_pos, key_len, sliding_window).unsqueeze(1)
    return positions, meta


class ForwardPass:
    """Prepares and runs steps of `model` over the KV pool its attention layers are bound to, and
    stateless forwards without the pool. Holds the decode programs (set by a compile switch)."""

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device, *, max_tokens: int,
                 max_seqs: int, max_blocks_per_seq: int, attention_backend: str = "auto"):
        self.model, self.block_size, self.device = model, block_size, device
        self.buffers = InputBuffers(max_tokens, max_seqs, max_blocks_per_seq, device)
        self.sliding_window = model.sliding_window
        self.attention_backend = resolve_attention_backend(attention_backend, device, block_size)
        self.decode_programs = None  # DecodePrograms for pure-decode steps (set when compiling)
        # the first attention layer, whose pool view tells the flex backend how many blocks the pool has
        self._attention = next((m for m in model.modules() if isinstance(m, Attention)), None)

    @property
    def decode_kernel(self) -> bool:
        """Whether the native CPU kernel runs attention (setting it switches between native and gather)."""
        return self.attention_backend == "native"

    @decode_kernel.setter
    def decode_kernel(self, on: bool) -> None:
        self.attention_backend = resolve_attention_backend("native" if on else "gather", self.device, self.block_size)

    def _to_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.device.type != "cpu":
            for name, value in vars(meta).items():
                if isinstance(value, torch.Tensor):
                    if name == "slot_mapping":
                        setattr(meta, name, self.buffers.to_device(name, value))
                    else:
                        setattr(meta, name, value.to(self.device, non_blocking=True))
        if meta.flex_q_rows is not None:
            finish_flex_fields(meta, self._attention.kv_cache.shape[2] // self.block_size)
        return meta

    def prepare(self, batch: StepBatch, multimodal: tuple[torch.Tensor, torch.Tensor] | None = None) -> ModelInput:
        """The step's model input; `multimodal`: image features for the batch's image tokens."""
        starts, counts, ids, tables = batch.starts, batch.num_new_tokens, batch.token_ids, batch.block_tables
        d, pad, decode_len = batch.num_decodes, 0, None
        if self.decode_programs is not None and d == len(starts) and multimodal is None:
            size = self.decode_programs.padded_size(d)
            if size is not None:  # pad rows repeat the first row
                pad, decode_len = size - d, self.decode_programs.static_decode_len
                starts, counts = starts + [starts[0]] * pad, counts + [1] * pad
                ids, tables = ids + [ids[0]] * pad, tables + [tables[0]] * pad
        filled = self.buffers.fill(ids, starts, counts, tables, self.block_size, full_rows=decode_len is not None)
        positions, meta = build_metadata(starts, counts, d + pad, self.block_size, self.sliding_window,
                                         self.decode_kernel, filled, decode_len, self.attention_backend == "flex")
        ends = torch.cumsum(torch.tensor(counts), 0) - 1
        return ModelInput(
            input_ids=self.buffers.to_device("input_ids", filled["input_ids"]),
            positions=self.buffers.to_device("positions", positions),
            meta=self._to_device(meta),
            logits_indices=ends[batch.sample_rows].to(self.device),
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=d,
            num_pad_tokens=pad,
            multimodal=multimodal,
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Logits [S, vocab] (float32) for the sequences that sample this step."""
        with set_forward_context(inp.meta, True, inp.multimodal):
            hidden = None
            if self.decode_programs is not None and not inp.num_prefill_tokens and inp.multimodal is None:
                hidden = self.decode_programs.run(inp.input_ids, inp.positions, inp.meta, inp.num_decode_tokens)
            if hidden is None:
                hidden = self.model(inp.input_ids, inp.positions)
        return self.model.compute_logits(hidden[inp.logits_indices]).float()

    @torch.inference_mode()
    def dummy_decode(self, size: int, decode_len: int | None = None):
        """(input ids, positions, metadata) on the device for a decode step of `size` dummy rows
        (token 0 at position 0): with `decode_len`, over the pool (block 0, that static key
        length), as a CUDA graph is captured; else stateless, as a decode program is compiled.
        Writes nothing itself."""
        starts, q_lens = [0] * size, [1] * size
        if decode_len is not None:
            filled = self.buffers.fill([0] * size, starts, q_lens, [[0]] * size, self.block_size, full_rows=True)
            positions, meta = build_metadata(starts, q_lens, size, self.block_size, self.sliding_window,
                                             self.decode_kernel, filled, decode_len,
                                             self.attention_backend == "flex")
        else:
            self.buffers.np["input_ids"][:size] = self.buffers.np["positions"][:size] = 0
            _, meta = build_metadata(starts, q_lens, size, self.block_size, self.sliding_window)
        bufs = self.buffers  # their slices, as in a real step (a compiled program's guards see no difference)
        ids = bufs.to_device("input_ids", bufs.cpu["input_ids"][:size])
        return ids, bufs.to_device("positions", bufs.cpu["positions"][:size]), self._to_device(meta)

    @torch.inference_mode()
    def run_dummy(self, num_tokens: int) -> torch.Tensor:
        """One sequence of `num_tokens` dummy tokens through the engine's own input buffers and
        without the pool (compile warm-up, profiling): the same tensor kinds as a real step."""
        bufs = self.buffers
        bufs.np["input_ids"][:num_tokens] = 0
        bufs.np["positions"][:num_tokens] = range(num_tokens)
        positions, meta = build_metadata([0], [num_tokens], int(num_tokens == 1), self.block_size, self.sliding_window)
        ids = bufs.to_device("input_ids", bufs.cpu["input_ids"][:num_tokens])
        pos = bufs.to_device("positions", bufs.cpu["positions"][:num_tokens])
        with set_forward_context(self._to_device(meta), False):
            return self.model(ids, pos)

    def run_stateless(self, seqs_ids: list[list[int]], return_order: bool = False):
        """Full causal forward of independent sequences without the pool; hidden states [N, H] in the
        caller's order (with `return_order`, also the index that took the model's token order there)."""
        q_lens = [len(x) for x in seqs_ids]
        num_decodes = sum(1 for n in q_lens if n == 1)
        order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] > 1)
        q_sorted = [q_lens[i] for i in order]
        positions, meta = build_metadata([0] * len(order), q_sorted, num_decodes, self.block_size,
                                         self.sliding_window)
        ids = torch.tensor(list(chain.from_iterable(seqs_ids[i] for i in order)), device=self.device)
        # made outside inference mode and passed as views, like the engine's buffer slices, so a
        # compiled model sees the same kind of tensor (its guards check both) and does not recompile
        with torch.inference_mode(), set_forward_context(self._to_device(meta), False):
            hidden = self.model(ids[:], positions.to(self.device)[:])
        # back to the caller's order
        offsets = torch.cumsum(torch.tensor([0] + q_sorted), 0)
        caller_order = sorted(range(len(order)), key=lambda k: order[k])
        back = torch.cat([torch.arange(offsets[k], offsets[k + 1]) for k in caller_order]).to(self.device)
        return (hidden[back], back) if return_order else hidden[back]
