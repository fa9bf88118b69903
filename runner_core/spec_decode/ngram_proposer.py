"""Proposers: what drafts the tokens a step verifies. `Proposer` is the interface (vLLM's name for the role):
`propose(seqs, limits)` gives each sequence's draft token ids, at most its limit, and `draft_probs` the
distribution each draft was drawn from (None: a point mass, q(x) = 1, as for prompt lookup). The draft model
is the other Proposer (runner_core/engine/draft_model.py: its own weights, KV pool and forward passes).

`NgramProposer` is prompt lookup (vLLM's "ngram" method, transformers' prompt_lookup_num_tokens, llama.cpp's
lookup decoding): the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min, are looked
up in its prompt and output so far; at the most recent earlier occurrence of the longest n that occurs, the up
to k tokens that followed it are the drafts. No second model: free to run, and right as often as the text copies
itself (code being edited, a summary quoting its source, a small model repeating itself).

The lookup is vectorised over the history (numpy): one comparison of the whole history with the last token gives
the candidate positions, each longer n keeps the candidates whose preceding token matches too (a few small array
operations). Each request's history is kept as a numpy array, extended by its new tokens each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class ProposalSequence(Protocol):
    """What a proposer reads of a sequence (the engine's Sequence is one)."""

    request_id: str
    token_ids: list[int]


class Proposer(Protocol):
    """Drafts tokens for running sequences (RejectionSampler takes either kind of draft distribution)."""

    def propose(self, seqs: Sequence[ProposalSequence], limits: Sequence[int],
                running: Sequence[ProposalSequence] = ()) -> list[list[int]]:
        """Each sequence's draft token ids (at most its limit; [] for none), following its token_ids; `running`:
        every running sequence (what a proposer keeps of the others may go)."""
        ...

    def draft_probs(self, seqs: Sequence[ProposalSequence], num_drafts: Sequence[int]):
        """The distributions [sum(num_drafts), vocab] the first num_drafts drafts of each of `seqs` were drawn
        from, in turn; None when every draft is a point mass (q(x) = 1)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget what the proposer keeps of a finished request."""
        ...


def ngram_lookup(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> np.ndarray:
    """The up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of `tokens`
    of length n_max down to n_min that occurs earlier; an empty array when none does."""
    size = len(tokens)
    if size < 2 or k < 1:
        return tokens[:0]
    # candidates: positions j (an occurrence ending at j, j before the last token) matching the last m tokens
    cand = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])
    best, m = -1, 1
    while cand.size:
        if m >= n_min:
            best = int(cand[-1])  # the most recent occurrence of the m-gram
        if m >= n_max or m >= size - 1:
            break
        cand = cand[cand >= m]
        cand = cand[tokens[cand - m] == tokens[size - 1 - m]]
        m += 1
    return tokens[best + 1:best + 1 + k] if best >= 0 else tokens[:0]


class NgramProposer:
    """Prompt-lookup drafts of up to `k` tokens from n-grams of `n_max` down to `n_min` tokens."""

    def __init__(self, k: int, n_max: int, n_min: int):
        self.k, self.n_max, self.n_min = k, n_max, n_min
        self._history: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(self, seqs: Sequence[ProposalSequence], limits: Sequence[int],
                running: Sequence[ProposalSequence] = ()) -> list[list[int]]:
        return [ngram_lookup(self._tokens(s), self.n_max, self.n_min, min(self.k, limit)).tolist() if limit > 0
                else [] for s, limit in zip(seqs, limits)]

    def _tokens(self, seq: ProposalSequence) -> np.ndarray:
        """`seq.token_ids` as a numpy array, kept across steps and extended by the tokens new since the last."""
        ids = seq.token_ids
        buf, filled = self._history.get(seq.request_id, (None, 0))
        if buf is None or filled > len(ids):  # new (or a reused id)
            buf, filled = np.empty(max(64, 2 * len(ids)), dtype=np.int64), 0
        if len(ids) > len(buf):
            buf = np.concatenate([buf[:filled], np.empty(len(ids), dtype=np.int64)])
        buf[filled:len(ids)] = ids[filled:]
        self._history[seq.request_id] = (buf, len(ids))
        return buf[:len(ids)]

    def draft_probs(self, seqs: Sequence[ProposalSequence], num_drafts: Sequence[int]) -> None:
        return None  # every draft is a point mass

    def release(self, request_id: str) -> None:
        self._history.pop(request_id, None)
