"""DraftModelProposer: speculative decoding's second proposer (vLLM's "draft_model" method), a smaller model with
the target's vocabulary that drafts k tokens autoregressively for every running decode, in k batched forward
passes over its own paged KV pool.

The draft is a second Worker: its own weights, its own MemoryManager and KV pool (as many blocks of the same
block_size as the target's pool: the KV budget is split so both hold the same tokens, memory/sizing.py's
`draft_kv_share`), its own ForwardPass and block tables, eager (never compiled). Each draft sequence mirrors a
target sequence by request id: `DraftSeq`, its block table in the draft's pool and the tokens whose K/V it holds.

A step (`propose`): each asking sequence's pending tokens (those the draft has not seen: the whole prompt at
first, then the token the target sampled last, and after a fully accepted run the last draft too) go in one
forward pass as chunks (decodes first; a prompt longer than the step's token budget is fed in pieces first),
which gives draft 1 at each row's last position; passes 2..k feed the previous draft, one token per row, the
rows still drafting. Every pass is one StepBatch over flat tensors. A row samples from its own processed
distribution q (the request's temperature, top-k, top-p, min-p; its seeded generator when it has one), kept
per request for the RejectionSampler (`draft_probs`); a greedy row takes the argmax (q unused: greedy
verification compares argmaxes).

Rollback: the draft's K/V holds the sequence's tokens then drafts 1..k-1. At the next step the accepted prefix is
the target's tokens up to the first draft that differs from what was accepted; the draft's computed length is cut
there and the blocks past it go back to its pool (MemoryManager.trim): the corrected or bonus token is fed next.
A request no longer running (preempted, aborted, finished) has its draft blocks freed at the next step, or at
once through `release`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runner_core.engine.input_batch import StepBatch
from runner_core.engine.worker import Worker
from runner_core.errors import ConfigError
from runner_core.layers.sampler import SamplingMetadata, draw, greedy, processed_probs
from runner_core.loader.model_loader import ModelLoader
from runner_core.memory.draft import draft_config


@dataclass(slots=True)
class DraftSeq:
    """A target sequence's mirror in the draft's pool (MemoryManager's Sequence protocol)."""

    request_id: str
    block_table: list[int] = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    num_sent_blocks: int = 0
    num_tokens: int = 0  # what its blocks cover
    num_computed_tokens: int = 0  # the tokens whose K/V the draft holds
    num_cached_tokens: int = 0
    base: int = 0  # the target's token count when it last drafted
    fed: list[int] = field(default_factory=list)  # the drafts fed after `base` (drafts 1..k-1)

    def block_key(self, index: int, block_size: int) -> tuple:
        return (self.request_id, index)  # never cached: the draft's pool has no prefix cache


class DraftModelProposer:
    """Drafts up to `k` tokens per sequence with a draft model loaded beside the target (`load`)."""

    def __init__(self, worker: Worker, k: int, max_tokens: int):
        self.worker, self.k, self.max_tokens = worker, k, max_tokens
        self.memory, self.device, self.vocab_size = worker.memory, worker.device, worker.vocab_size
        self.seqs: dict[str, DraftSeq] = {}
        self._probs: dict[str, torch.Tensor | None] = {}  # request id -> q of its current drafts [k', V]
        self._freed: list[str] = []

    @classmethod
    def load(cls, config, model: str, k: int, vocab_size: int, tokenizer, num_blocks: int,
             max_model_len: int) -> DraftModelProposer:
        """The draft `model` loaded under `config` (the target's RunnerConfig) with a pool of `num_blocks` blocks
        (the target's count); a draft whose vocabulary differs from the target's is refused (ConfigError)."""
        dconfig = draft_config(config, num_blocks, max_model_len)
        loaded = ModelLoader(dconfig).load()
        worker = Worker(dconfig, loaded)
        theirs, ours = (getattr(getattr(t, "hf", None), "get_vocab", dict)() for t in (loaded.tokenizer, tokenizer))
        if worker.vocab_size != vocab_size or theirs != ours:
            raise ConfigError(
                f"config field 'speculative_config': the draft model {model!r} has another vocabulary than the "
                f"target ({worker.vocab_size} ids against {vocab_size}, or other token strings): a draft must share "
                "its target's tokenizer; use a draft trained with the target's tokenizer (such as tiny-speaker-draft "
                "for tiny-speaker) or method 'ngram'")
        return cls(worker, k, config.effective_max_num_batched_tokens)

    # ---- a step ---------------------------------------------------------------------------
    def propose(self, seqs: Sequence, limits: Sequence[int], running: Sequence = ()) -> list[list[int]]:
        """Each sequence's drafts (at most its limit), drawn from the draft's distribution under the sequence's
        sampling settings; the draft state of requests not in `running` (or `seqs`) is freed first."""
        live = {s.request_id for s in running} | {s.request_id for s in seqs}
        for rid in [rid for rid in self.seqs if rid not in live]:
            self.release(rid)
        self._probs = {}
        rows, ks, pending = [], [], []
        for s, limit in zip(seqs, limits):
            k = min(self.k, limit)
            d = self._rolled_back(s)
            tokens = s.token_ids
            if k <= 0 or not self._fits(d, len(tokens) + k - 1):
                continue
            rows.append((s, d))
            ks.append(k)
            pending.append(tokens[d.num_computed_tokens:])
        drafts: list[list[int]] = [[] for _ in rows]
        if not rows:
            return self._in_order(seqs, rows, drafts)
        self._catch_up(rows, pending)
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = list(range(len(rows)))
        for j in range(max(ks)):
            feed = [pending[i] if j == 0 else [drafts[i][-1]] for i in active]
            logits = self._forward([rows[i][1] for i in active], feed)
            tokens, probs = self._sample(logits, [rows[i][0] for i in active])
            for n, i in enumerate(active):
                drafts[i].append(tokens[n])
                if probs is not None and rows[i][0].params.temperature > 0:  # a greedy row's q is never read
                    qs[i].append(probs[n])
            active = [i for i in active if len(drafts[i]) < ks[i]]
            if not active:
                break
        for (s, d), dr, q in zip(rows, drafts, qs):
            d.base, d.fed = len(s.token_ids), dr[:-1]
            self._probs[s.request_id] = torch.stack(q) if q else None
        return self._in_order(seqs, rows, drafts)

    def draft_probs(self, seqs: Sequence, num_drafts: Sequence[int]) -> torch.Tensor | None:
        """q [sum(num_drafts), V] of the drafts `seqs` verify (the first num_drafts of each's), None when every
        row is greedy (q is not read)."""
        qs = [self._probs.get(s.request_id) for s in seqs]
        if any(q is None for q in qs):
            if all(q is None for q in qs):
                return None
            qs = [torch.zeros(n, self.vocab_size) if q is None else q for q, n in zip(qs, num_drafts)]
        return torch.cat([q[:n] for q, n in zip(qs, num_drafts)]).to(torch.float32)

    def release(self, request_id: str) -> None:
        d = self.seqs.pop(request_id, None)
        self._probs.pop(request_id, None)
        if d is not None:
            self.memory.free(d)
            self._freed.append(request_id)

    # ---- its parts ------------------------------------------------------------------------
    def _rolled_back(self, s) -> DraftSeq:
        """`s`'s draft state, its K/V cut back to the tokens the target accepted."""
        d = self.seqs.get(s.request_id)
        if d is None:
            d = self.seqs[s.request_id] = DraftSeq(s.request_id)
            return d
        tokens, accepted = s.token_ids, 0
        for a, b in zip(d.fed, tokens[d.base:]):
            if a != b:
                break
            accepted += 1
        d.num_computed_tokens = min(d.num_computed_tokens, d.base + accepted, len(tokens))
        d.fed = []
        self.memory.trim(d, d.num_computed_tokens)
        d.num_tokens = d.num_computed_tokens
        return d

    def _fits(self, d: DraftSeq, num_tokens: int) -> bool:
        """Blocks for `num_tokens` tokens in the draft's pool (False, nothing allocated, when it is full)."""
        if not self.memory.can_allocate(d, num_tokens):
            return False
        self.memory.allocate(d, num_tokens)
        d.num_tokens = max(d.num_tokens, num_tokens)
        return True

    def _catch_up(self, rows: list, pending: list[list[int]]) -> None:
        """Feed the longest pending runs in pieces (no sampling) until one pass holds every row's rest."""
        while sum(map(len, pending)) > self.max_tokens:
            room, dseqs, feed = self.max_tokens - len(rows), [], []
            for i, p in enumerate(pending):
                n = min(len(p) - 1, room)
                if n > 0:
                    dseqs.append(rows[i][1])
                    feed.append(p[:n])
                    pending[i], room = p[n:], room - n
            self._forward(dseqs, feed, sample=False)

    def _forward(self, dseqs: list[DraftSeq], feed: list[list[int]], sample: bool = True) -> torch.Tensor:
        """One draft forward pass: each sequence's `feed` tokens after its computed ones (decodes first); the
        logits [rows, V] at each row's last position, in the given order."""
        order = sorted(range(len(dseqs)), key=lambda i: len(feed[i]) > 1)
        ds = [dseqs[i] for i in order]
        new_blocks = [(d.request_id, d.num_sent_blocks, d.block_table[d.num_sent_blocks:]) for d in ds
                      if len(d.block_table) > d.num_sent_blocks]
        counts = [len(feed[i]) for i in order]
        batch = StepBatch(request_ids=[d.request_id for d in ds], starts=[d.num_computed_tokens for d in ds],
                          num_new_tokens=counts, token_ids=[t for i in order for t in feed[i]],
                          num_decodes=sum(1 for n in counts if n == 1),
                          sample_rows=list(range(len(ds))) if sample else [], new_blocks=new_blocks,
                          freed=self._freed)
        self._freed = []
        logits = self.worker.execute_model(batch)[0]
        for d, n in zip(ds, counts):
            d.num_computed_tokens += n
            d.num_sent_blocks = len(d.block_table)
        if not sample:
            return logits
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(logits.device)]

    def _sample(self, logits: torch.Tensor, seqs: list) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft and, unless every row is greedy, the distributions q they were drawn from."""
        meta = SamplingMetadata.build([s.params for s in seqs], [s.generator for s in seqs], self.vocab_size,
                                      logits.device)
        logits = logits.float()
        if meta.all_greedy:
            return greedy(logits).tolist(), None
        probs = processed_probs(logits, meta)
        drawn = draw(probs, meta)
        if not meta.all_random:
            drawn = torch.where(meta.temperature == 0, greedy(logits), drawn)
        return drawn.tolist(), probs

    @staticmethod
    def _in_order(seqs: Sequence, rows: list, drafts: list[list[int]]) -> list[list[int]]:
        by_id = {s.request_id: dr for (s, _), dr in zip(rows, drafts)}
        return [by_id.get(s.request_id, []) for s in seqs]

    def stats(self) -> dict:
        """The draft's pool: blocks, free blocks, bytes."""
        return {"draft_kv_blocks": self.memory.num_blocks, "draft_kv_free_blocks": self.memory.num_free_blocks,
                "draft_kv_cache_bytes": self.memory.kv_cache_bytes, "draft_weights_bytes": self.worker.weights_bytes}
