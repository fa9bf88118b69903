"""ForwardPass: turns a step's batch into the model's input once per step and runs the model.

Layout: decode sequences (one new token) first, then prefill chunks (and decodes carrying speculative drafts,
which run as a chunk of their last token and drafts; never through the one-token decode programs). A
`StepBatch` says, per sequence, where its new tokens start, how many there are, those tokens and the entries its block
table gained; the rank's BlockTable takes those in, and `InputBuffers.fill` writes the step into
buffers allocated once (ids, positions, slot mapping, block tables) and returns the step's
`CommonAttentionMetadata`, from which the attention backend's builder
(`METADATA_BUILDERS`: gather, native, flex, each beside its backend in layers/) makes that
backend's metadata, with tensor operations; no per-token loops. Every rank of a parallel runner
prepares the same batch over its own KV shard.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain

import torch

from runner_core.engine.input_batch import BlockTable, InputBuffers, StepBatch
from runner_core.layers.attention import (
    Attention,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    resolve_attention_backend,
    set_forward_context,
)
from runner_core.layers.flex_attention import FlexMetadataBuilder
from runner_core.layers.gather_attention import GatherMetadataBuilder
from runner_core.layers.native_attention import NativeMetadataBuilder

# each attention backend's metadata builder (resolve_attention_backend names them)
METADATA_BUILDERS: dict[str, AttentionMetadataBuilder] = {
    "gather": GatherMetadataBuilder(), "native": NativeMetadataBuilder(), "flex": FlexMetadataBuilder()}


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: object  # the attention backend's metadata, on the device
    logits_indices: torch.Tensor  # [S + D + P] flat index: each sampling row's last token, drafts, prompt
    num_prefill_tokens: int
    num_decode_tokens: int
    num_pad_tokens: int = 0  # rows added to reach a decode program's size (repeats of the first row)
    multimodal: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat positions, image features) to merge


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

    def _metadata(self, common: CommonAttentionMetadata, backend: str | None = None):
        """The backend's metadata for the step (default: this pass's backend), on the device. The
        slot mapping goes through its persistent device twin; the rest is copied as it is."""
        builder = METADATA_BUILDERS[backend or self.attention_backend]
        meta = builder.build(common)
        if self.device.type != "cpu":
            for f in dataclasses.fields(meta):
                value = getattr(meta, f.name)
                if isinstance(value, torch.Tensor):
                    setattr(meta, f.name, self.buffers.to_device(f.name, value) if f.name == "slot_mapping"
                            else value.to(self.device, non_blocking=True))
        builder.finish(meta, common)
        return meta

    def _num_pool_blocks(self) -> int:
        return self._attention.kv_cache.shape[2] // self.block_size if self._attention is not None else 0

    def prepare(self, batch: StepBatch, multimodal: tuple[torch.Tensor, torch.Tensor] | None = None) -> ModelInput:
        """The step's model input; `multimodal`: image features for the batch's image tokens."""
        rows = self.buffers.block_table.update(batch.freed, batch.new_blocks, batch.request_ids)
        starts, counts, ids = batch.starts, batch.num_new_tokens, batch.token_ids
        d, pad, decode_len = batch.num_decodes, 0, None
        if self.decode_programs is not None and d == len(starts) and multimodal is None:
            size = self.decode_programs.padded_size(d)
            if size is not None:  # pad rows repeat the first row
                pad, decode_len = size - d, self.decode_programs.static_decode_len
                starts, counts = starts + [starts[0]] * pad, counts + [1] * pad
                ids, rows = ids + [ids[0]] * pad, rows + [rows[0]] * pad
        common = self.buffers.fill(ids, starts, counts, d + pad, rows, self.block_size, self.sliding_window,
                                   decode_len=decode_len, num_pool_blocks=self._num_pool_blocks())
        ends = torch.cumsum(common.query_lens, 0) - 1
        logits_indices = ends[batch.sample_rows]
        if batch.spec_rows:  # each verified row's positions before its last: its first token's on
            rows, drafts = torch.tensor(batch.spec_rows).T
            within = torch.arange(int(drafts.sum())) - torch.repeat_interleave(torch.cumsum(drafts, 0) - drafts, drafts)
            firsts = torch.repeat_interleave((ends - common.query_lens + 1)[rows], drafts)
            logits_indices = torch.cat([logits_indices, firsts + within])
        if batch.prompt_logits:  # flat index of a row's position p: the row's first token's, plus p - start
            firsts = ends - common.query_lens + 1
            logits_indices = torch.cat([logits_indices, *(torch.arange(c) + (firsts[r] + p - batch.starts[r])
                                                          for r, p, c in batch.prompt_logits)])
        return ModelInput(
            input_ids=self.buffers.to_device("input_ids", self.buffers.cpu["input_ids"][:len(ids)]),
            positions=self.buffers.to_device("positions", common.positions),
            meta=self._metadata(common),
            logits_indices=logits_indices.to(self.device),
            num_prefill_tokens=batch.num_prefill_tokens,  # a verified decode's tokens count: it runs as a chunk
            num_decode_tokens=d,
            num_pad_tokens=pad,
            multimodal=multimodal,
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Logits [S + P, vocab] (float32) for the sequences that sample this step, then for the P prompt
        positions whose logprobs are asked (`StepBatch.prompt_logits`)."""
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
        if decode_len is not None:
            return self.dummy_step([1] * size, decode_len)
        self.buffers.np["input_ids"][:size] = self.buffers.np["positions"][:size] = 0
        meta = self._stateless_metadata([0] * size, [1] * size, size)
        bufs = self.buffers  # their slices, as in a real step (a compiled program's guards see no difference)
        ids = bufs.to_device("input_ids", bufs.cpu["input_ids"][:size])
        return ids, bufs.to_device("positions", bufs.cpu["positions"][:size]), meta

    @torch.inference_mode()
    def dummy_step(self, q_lens: list[int], decode_len: int | None = None):
        """(input ids, positions, metadata) on the device for a step over the pool of dummy sequences of
        `q_lens` new tokens from position 0 (ones first: the decodes), every one reading and writing block 0
        through the zero row of the block tables, each with every column (`decode_len`, default
        max_model_len in whole blocks). Writes nothing itself; the caller keeps block 0's contents."""
        n, rows = sum(q_lens), len(q_lens)
        common = self.buffers.fill([0] * n, [0] * rows, q_lens, sum(1 for q in q_lens if q == 1),
                                   [BlockTable.ZERO_ROW] * rows, self.block_size, self.sliding_window,
                                   decode_len=decode_len or self.buffers.max_blocks * self.block_size,
                                   num_pool_blocks=self._num_pool_blocks())
        bufs = self.buffers  # their slices, as in a real step (a compiled program's guards see no difference)
        ids = bufs.to_device("input_ids", bufs.cpu["input_ids"][:n])
        return ids, bufs.to_device("positions", bufs.cpu["positions"][:n]), self._metadata(common)

    def _stateless_metadata(self, starts: list[int], q_lens: list[int], num_decodes: int):
        """The gather backend's metadata, on the device, for sequences attending over the step's own tokens."""
        return self._metadata(CommonAttentionMetadata.without_pool(starts, q_lens, num_decodes, self.block_size,
                                                                   self.sliding_window), "gather")

    @torch.inference_mode()
    def run_dummy(self, num_tokens: int) -> torch.Tensor:
        """One sequence of `num_tokens` dummy tokens through the engine's own input buffers and
        without the pool (compile warm-up, profiling): the same tensor kinds as a real step."""
        bufs = self.buffers
        bufs.np["input_ids"][:num_tokens] = 0
        bufs.np["positions"][:num_tokens] = range(num_tokens)
        meta = self._stateless_metadata([0], [num_tokens], int(num_tokens == 1))
        ids = bufs.to_device("input_ids", bufs.cpu["input_ids"][:num_tokens])
        pos = bufs.to_device("positions", bufs.cpu["positions"][:num_tokens])
        with set_forward_context(meta, False):
            return self.model(ids, pos)

    def run_stateless(self, seqs_ids: list[list[int]], return_order: bool = False):
        """Full causal forward of independent sequences without the pool; hidden states [N, H] in the
        caller's order (with `return_order`, also the index that took the model's token order there)."""
        q_lens = [len(x) for x in seqs_ids]
        num_decodes = sum(1 for n in q_lens if n == 1)
        order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] > 1)
        q_sorted = [q_lens[i] for i in order]
        common = CommonAttentionMetadata.without_pool([0] * len(order), q_sorted, num_decodes, self.block_size,
                                                      self.sliding_window)
        meta = self._metadata(common, "gather")
        ids = torch.tensor(list(chain.from_iterable(seqs_ids[i] for i in order)), device=self.device)
        # made outside inference mode and passed as views, like the engine's buffer slices, so a
        # compiled model sees the same kind of tensor (its guards check both) and does not recompile
        with torch.inference_mode(), set_forward_context(meta, False):
            hidden = self.model(ids[:], common.positions.to(self.device)[:])
        # back to the caller's order
        offsets = torch.cumsum(torch.tensor([0] + q_sorted), 0)
        caller_order = sorted(range(len(order)), key=lambda k: order[k])
        back = torch.cat([torch.arange(offsets[k], offsets[k + 1]) for k in caller_order]).to(self.device)
        return (hidden[back], back) if return_order else hidden[back]
