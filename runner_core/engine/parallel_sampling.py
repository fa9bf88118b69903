"""Parallel sampling (`SamplingParams.n`, `best_of`): vLLM's ParentRequest. A request's prompt is prefilled
once, as one sequence (chunked as usual); the step that samples its first token forks it into
`params.num_sequences` sequences (best_of if given, else n), each sampling its own first token from the same
last-prompt logits (the batch repeats the parent's sampling row: `StepBatch.build`, `Sequence.fork_into`).

The children share every block of the parent (reference counts in the pool, `MemoryManager.fork`); the
partial last block is copied by the first child that writes into it (`MemoryManager.allocate`: copy on
write, made on every rank before the step's forward). Child 0 is the parent itself (its request id, its
block-table row, its prompt logprobs); child i > 0 is `{request id}#{i}`. With a seed, child i samples from a
generator seeded `seed + i` (vLLM's rule): it gives the tokens an n=1 request with that seed gives.

Preemption: each sequence alone. After the fork the children are independent sequences, each holding its
prompt and its own tokens, so the scheduler preempts the newest by recompute as any other: its siblings keep
their blocks and go on, and on its return it recomputes its prompt and its own tokens (with prefix caching
the prompt's full blocks are found cached and shared again, so only its own tokens are recomputed).
Preempting the whole group would free far more than the step needs and stall n sequences for want of a
block or two (vLLM v0 could not recompute a multi-sequence group and swapped it to host memory instead;
this engine recomputes). A parent preempted before its fork is an ordinary sequence and forks when its prompt
completes again.

Outputs: one RequestOutput per step for the group, under its request id: streamed, the completions that
advanced; at the end all of them, by index; with best_of > n, the n with the highest cumulative logprob
(the raw log-softmax logprobs of their sampled tokens), best first, and nothing before the end (the best are
known only then). A member that fails (non-finite logits, a grammar's refusal) fails the request; an abort
ends every member.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from runner_core.engine.output_processor import OutputProcessor
from runner_core.engine.sequence import CompletionOutput, RequestOutput, Sequence, SequenceStatus
from runner_core.errors import InvalidRequestError
from runner_core.loader.tokenizer import IncrementalDetokenizer
from runner_core.sampling_params import SamplingParams

CHILD_ID = re.compile(r".*#\d+")  # a child's request id: its parent's, then '#' and its index


def check_parallel_sampling(params: SamplingParams, request_id: str, max_num_seqs: int) -> None:
    """Refuse what a request cannot run: more sequences than run at once, an id of a child's form."""
    if params.num_sequences > max_num_seqs:
        field = "best_of" if params.best_of is not None else "n"
        raise InvalidRequestError(f"SamplingParams.{field}={params.num_sequences} sequences run at once but "
                                  f"max_num_seqs is {max_num_seqs}; lower {field} or raise max_num_seqs")
    if CHILD_ID.fullmatch(request_id):
        raise InvalidRequestError(f"request id {request_id!r} ends in '#' and digits, the form of a parallel "
                                  "sample's id; choose another")


class ParentRequest:
    """The sequences of one request with n or best_of > 1 (`children`, by index; the parent alone until the
    fork), and its outputs. `stream`: the request streams (outputs as its sequences advance)."""

    def __init__(self, seq: Sequence, stream: bool):
        self.request_id, self.params, self.metrics = seq.request_id, seq.params, seq.metrics
        self.prompt_ids = list(seq.token_ids)
        self.ranked = self.params.num_sequences > self.params.n  # best_of: the n best by cumulative logprob
        self.streams = stream and not self.ranked
        self.children = [seq]
        self.done = False  # its final output was made
        seq.params, seq.fork_into, seq.group = self.child_params(0), self.params.num_sequences, self

    def child_params(self, index: int) -> SamplingParams:
        """Child `index`'s params: one sequence, seed + index; with best_of, the sampled tokens' logprobs kept."""
        p = self.params
        logprobs = 0 if self.ranked and p.logprobs is None else p.logprobs
        seed = None if p.seed is None else (p.seed + index) % 2**64
        return p.replace(n=1, best_of=None, seed=seed, logprobs=logprobs)

    def fork(self, memory) -> list[Sequence]:
        """The parent's new children 1.. (as the step that completes its prompt samples): its blocks shared,
        its prompt computed (that step's forward writes its last chunk before any child reads it)."""
        parent = self.children[0]
        parent.fork_into = 1
        for i in range(1, self.params.num_sequences):
            params = self.child_params(i)
            generator = None
            if parent.generator is not None:
                generator = torch.Generator(parent.generator.device).manual_seed(params.seed)
            child = Sequence(request_id=f"{self.request_id}#{i}", prompt=parent.prompt, token_ids=list(self.prompt_ids),
                             num_prompt_tokens=parent.num_prompt_tokens, params=params, generator=generator,
                             status=SequenceStatus.RUNNING, num_computed_tokens=parent.num_tokens,
                             num_cached_tokens=parent.num_cached_tokens, mm_items=parent.mm_items,
                             metrics=parent.metrics, group=self)
            memory.fork(parent, child)
            if parent.detokenizer is not None:
                child.detokenizer = IncrementalDetokenizer(parent.detokenizer.tokenizer, self.prompt_ids,
                                                           params.skip_special_tokens)
            if parent.logprobs is not None:  # (a simulated runner keeps none)
                child.logprobs = []
            self.children.append(child)
        return self.children[1:]

    def live(self) -> list[Sequence]:
        return [c for c in self.children if not c.is_finished]

    def output(self, updates: list[tuple[Sequence, list[int], str]], processor: OutputProcessor,
               now: float) -> RequestOutput | None:
        """The request's output for this step's `updates` (child, new ids, new text): streamed, the children
        that advanced; once every child finished, the final one (once); else None."""
        if self.done:
            return None
        finished = all(c.is_finished for c in self.children)
        if not finished and not self.streams:
            return None
        if not finished:
            outs = [processor.completion(c, self.children.index(c), ids, text) for c, ids, text in updates]
        else:
            new = {id(c): (ids, text) for c, ids, text in updates}
            outs = [processor.completion(c, i, *new.get(id(c), ([], ""))) for i, c in enumerate(self.children)]
            if not self.streams:  # nothing was handed out before: all of it is new
                outs = [dataclasses.replace(c, delta_token_ids=c.token_ids, delta_text=c.text) for c in outs]
            if self.ranked:
                outs = sorted(outs, key=_score, reverse=True)[:self.params.n]
                outs = [dataclasses.replace(c, index=i) for i, c in enumerate(outs)]
            self._finish(now)
        if self.params.logprobs is None:  # kept for the ranking only
            outs = [dataclasses.replace(c, logprobs=None) for c in outs]
        error = next((c.error for c in self.children if c.error is not None), None)
        parent = self.children[0]
        return RequestOutput.of(self.request_id, parent.prompt, self.prompt_ids, outs, finished, error,
                                self.metrics.as_dict(parent.num_cached_tokens), parent.prompt_logprobs)

    def _finish(self, now: float) -> None:
        """End the request's shared RequestMetrics: its reason the first child's, or the error."""
        self.done = True
        error = next((c.error for c in self.children if c.error is not None), None)
        reason = "error" if error is not None else self.children[0].finish_reason
        self.metrics.finished_time = now
        self.metrics.finish(now, reason, error)


def _score(c: CompletionOutput) -> float:
    return c.cumulative_logprob if c.cumulative_logprob is not None else float("-inf")


def expand_forks(seqs: list[Sequence], fork) -> list[Sequence]:
    """The step's sampled sequences with each forking parent's repeated rows (StepBatch.build) given to it and
    its new children, `fork(parent)`, in the rows' order."""
    out, i = [], 0
    while i < len(seqs):
        seq, k = seqs[i], seqs[i].fork_into
        out += [seq, *fork(seq)] if k > 1 else [seq]
        i += k
    return out
