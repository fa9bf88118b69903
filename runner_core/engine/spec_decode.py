"""Speculative decoding in the engine's step (`SpecDecoder`, made when RunnerConfig.speculative_config is set):
draft, verify in the step's one forward pass, accept, roll back.

1. Draft (`propose`, before the scheduler runs): each running decode gets up to k draft tokens from the proposer
   (runner_core/spec_decode: prompt lookup; engine/draft_model.py: a draft model, which also rolls its own KV
   back to the accepted tokens at its next step), into `Sequence.spec_token_ids`, never more than its max_tokens and
   max_model_len leave room for. Sequences with a grammar (structured outputs) or asking for logprobs get none:
   they decode one token a step, beside the others.
2. Schedule (`Scheduler.schedule`): a decode with drafts is 1 + k' tokens of the step's budget (its last sampled
   token, then the drafts), k' cut to what the budget leaves; the drafts are dropped before anything is preempted
   for their blocks, and a preempted sequence drops its drafts.
3. Verify: the row runs as a chunk, like a prefill chunk, in the same forward pass as the other decodes and
   prefill chunks (`StepBatch.spec_rows`; the attention backends take per-row query lengths; the one-token decode
   programs and CUDA graphs never see such a step). Its logits come at every position: the last (the bonus
   token's, sampled by the Sampler with the other rows) and one per draft (`StepBatch.num_logits`).
4. Accept (`verify`): the RejectionSampler accepts a prefix of the drafts and draws the token replacing the first
   rejected one (exact: spec_decode/rejection_sampler.py); the row's tokens are the accepted drafts then that
   token, or the bonus token when all were accepted. The OutputProcessor appends them in turn, stopping at a stop
   token, EOS, stop string or max_tokens (what follows the stop is dropped).
5. Roll back (`settle`): the sequence's computed length is its accepted prefix (the rejected drafts' K/V slots are
   forgotten: written again by later tokens), the blocks past its tokens go back to the pool
   (MemoryManager.trim), and only then are its full blocks hashed for the prefix cache, so a cached block never
   holds a rejected draft.

With speculation off the engine has no SpecDecoder and the step does none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runner_core.engine.sequence import Sequence
from runner_core.errors import ConfigError
from runner_core.layers.sampler import SamplerOutput, SamplingMetadata
from runner_core.spec_decode import NgramProposer, Proposer, RejectionSampler, SpecDecodingStats, SpeculativeConfig


@dataclass
class SpeculativeSamplerOutput(SamplerOutput):
    """The Sampler's output (one token per row: a verified row's bonus token) with each verified row's tokens,
    `runs` (None for a row without drafts)."""

    runs: list[list[int] | None] = field(default_factory=list)

    def select(self, rows: list[int]) -> SpeculativeSamplerOutput:
        base = SamplerOutput.select(self, rows)
        return SpeculativeSamplerOutput(base.sampled_token_ids, base.logprob_token_ids, base.logprobs,
                                        [self.runs[i] for i in rows])


class SpecDecoder:
    """The engine's speculative decoding: its proposer, its rejection sampler and its figures."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int, vocab_size: int, proposer: Proposer | None = None):
        self.spec, self.max_model_len, self.vocab_size = spec, max_model_len, vocab_size
        self.proposer: Proposer = proposer or NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max,
                                                            spec.prompt_lookup_min)
        self.rejection_sampler = RejectionSampler()
        self.totals = SpecDecodingStats()  # since load (or the last reconfigure)
        self._verified: list[tuple[Sequence, int]] = []  # the step's verified sequences and their accepted drafts
        self._step: SpecDecodingStats | None = None

    @classmethod
    def create(cls, config, max_model_len: int, vocab_size: int, multimodal: bool, worker=None,
               tokenizer=None) -> SpecDecoder | None:
        """The engine's SpecDecoder for `config` (None when speculation is off); a model it cannot run refused.
        With a draft model, `worker` (the target's, whose pool's block count the draft's pool takes) and
        `tokenizer` (the target's, compared with the draft's) are needed: the draft is loaded here."""
        spec = SpeculativeConfig.of(config)
        if spec is None:
            return None
        if multimodal:
            raise ConfigError("config field 'speculative_config' is set for a multimodal model: speculative decoding "
                              "does not run with image inputs yet; load the model with speculative_config=None")
        if spec.model is None:
            return cls(spec, max_model_len, vocab_size)
        from runner_core.engine.draft_model import DraftModelProposer  # loads weights: only with a draft

        if worker is None:
            raise ConfigError("config field 'speculative_config' names a draft model, which needs a loaded target "
                              "(ModelRunner); use method 'ngram' here")
        proposer = DraftModelProposer.load(config, spec.model, spec.num_speculative_tokens, vocab_size, tokenizer,
                                           worker.memory.num_blocks, max_model_len)
        return cls(spec, max_model_len, vocab_size, proposer)

    def propose(self, running: list[Sequence]) -> None:
        """Draft tokens for every running decode (into `spec_token_ids`), within its max_tokens and max_model_len."""
        seqs, limits = [], []
        for s in running:
            p = s.params
            if (s.num_computed_tokens == s.num_tokens - 1 and s.num_output_tokens and p.logprobs is None
                    and p.structured_outputs is None):
                seqs.append(s)
                limits.append(min(p.max_tokens - s.num_output_tokens - 1, self.max_model_len - s.num_tokens))
        for s, drafts in zip(seqs, self.proposer.propose(seqs, limits, running)):
            s.spec_token_ids = drafts

    def verify(self, seqs: list[Sequence], sampled: SamplerOutput, draft_logits: torch.Tensor,
               spec_seqs: list[Sequence]) -> SpeculativeSamplerOutput:
        """The step's tokens: `sampled` (the Sampler's, one per row of `seqs`) with each verified sequence's run.
        `draft_logits` [drafts, V]: the logits at each of `spec_seqs`' draft positions, in turn."""
        drafts = [s.spec_token_ids for s in spec_seqs]
        device = draft_logits.device
        meta = SamplingMetadata.build([s.params for s in spec_seqs], [s.generator for s in spec_seqs],
                                      self.vocab_size, device)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=device)
        counts = [len(d) for d in drafts]
        out = self.rejection_sampler(draft_logits, flat, counts, meta, self.proposer.draft_probs(spec_seqs, counts))
        index = {id(s): i for i, s in enumerate(seqs)}
        rows = [index[id(s)] for s in spec_seqs]
        bonus = sampled.sampled_token_ids[torch.tensor(rows, device=sampled.sampled_token_ids.device)].tolist()
        runs: list[list[int] | None] = [None] * len(seqs)
        step = self._step = SpecDecodingStats()
        self._verified = []
        for seq, row, d, a, recovered, b in zip(spec_seqs, rows, drafts, out.num_accepted, out.recovered, bonus):
            runs[row] = d[:a] + [recovered if a < len(d) else b]
            step.observe(len(d), a)
            if seq.metrics.spec_decoding is None:
                seq.metrics.spec_decoding = SpecDecodingStats()
            seq.metrics.spec_decoding.observe(len(d), a)
            self._verified.append((seq, a))
        self.totals.add(step)
        return SpeculativeSamplerOutput(sampled.sampled_token_ids, sampled.logprob_token_ids, sampled.logprobs, runs)

    def settle(self, memory) -> None:
        """After the step's tokens were appended: each verified sequence still running counts its accepted drafts
        as computed, gives back the blocks past its tokens, and caches its full blocks."""
        for seq, accepted in self._verified:
            seq.spec_token_ids = []
            if seq.is_finished:  # released with its blocks
                continue
            seq.num_computed_tokens += accepted
            memory.trim(seq, seq.num_tokens)
            memory.cache_blocks(seq)
        self._verified = []

    def take_step_stats(self) -> SpecDecodingStats | None:
        """The last step's figures (None when it verified nothing), once."""
        step, self._step = self._step, None
        return step

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def stats(self) -> dict:
        """The settings and the totals since load (memory_stats()["spec_decoding"])."""
        extra = self.proposer.stats() if hasattr(self.proposer, "stats") else {}
        return {"method": self.spec.method, "num_speculative_tokens": self.spec.num_speculative_tokens,
                "model": self.spec.model, **extra, **self.totals.as_dict()}
