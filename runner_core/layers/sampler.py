"""Batched token sampling: greedy, temperature, top-k, top-p and min-p over the whole
batch at once, plus the logprobs of the raw logits (vLLM semantics).

Random rows use the exponential race, `argmax(probs / q)` with `q ~ Exp(1)`: unseeded rows
share one batched draw, a seeded row draws from its own generator, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from runner_core.kernels import argmax_rows, cpu_kernels_available
from runner_core.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors on the logits' device."""

    temperature: Tensor  # [B] float32, 0 for greedy rows
    top_p: Tensor  # [B] float32
    top_k: Tensor  # [B] int64, vocab_size when disabled
    min_p: Tensor  # [B] float32
    generators: dict[int, torch.Generator]  # row -> generator, seeded random rows only
    all_greedy: bool
    all_random: bool
    no_top_p_top_k_min_p: bool  # no random row filters its distribution: skip the sort
    max_num_logprobs: int | None  # None: no row asked for logprobs

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        if len(params) != len(generators):
            raise ValueError(f"got {len(params)} SamplingParams but {len(generators)} generators")
        greedy = [p.greedy for p in params]
        random_params = [p for p, g in zip(params, greedy) if not g]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)],
                dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([min(k, vocab_size) for k in top_k], dtype=torch.int64, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators={i: gen for i, gen in enumerate(generators) if gen is not None and not greedy[i]},
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_p_top_k_min_p=all(
                p.top_p == 1.0 and p.top_k in (0, -1) and p.min_p == 0.0 for p in random_params),
            max_num_logprobs=min(max(requested), vocab_size) if requested else None,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    logprob_token_ids: Tensor | None  # [B, n+1]: the sampled token, then the top n
    logprobs: Tensor | None  # [B, n+1] float32, matching logprob_token_ids

    def select(self, rows: list[int]) -> SamplerOutput:
        """The output of these rows only."""
        idx = torch.tensor(rows, device=self.sampled_token_ids.device)
        return SamplerOutput(*(None if t is None else t[idx] for t in
                               (self.sampled_token_ids, self.logprob_token_ids, self.logprobs)))


def nonfinite_rows(logits: Tensor) -> tuple[Tensor, list[int]]:
    """(logits with those rows zeroed, the rows) for rows holding a NaN or +inf, or nothing but -inf (a
    -inf alone is a masked token): the sampler then runs on every row, and those rows' requests fail
    instead of sampling garbage. One reduction per step: a row's max is NaN if any entry is."""
    bad = ~torch.isfinite(logits.amax(dim=-1))
    rows = bad.nonzero().flatten().tolist()
    return (logits.masked_fill(bad.unsqueeze(1), 0.0) if rows else logits), rows


def apply_top_k_top_p_min_p(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Masks (to -inf) the tokens each row's top-k, then top-p, then min-p filter drops."""
    logits_sort, order = logits.sort(dim=-1)  # ascending: the top token is last
    vocab_size = logits.shape[-1]
    ranks = torch.arange(vocab_size, device=logits.device)
    logits_sort.masked_fill_(ranks < (vocab_size - top_k).unsqueeze(1), float("-inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    # Top-p: drop a token when it and every smaller one together hold <= 1 - p of the mass,
    # leaving the smallest set that holds >= p. The top token always stays.
    drop = probs_sort.cumsum(dim=-1) <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    # Min-p: relative to the top token, so renormalising after top-p changes nothing.
    drop |= probs_sort < (min_p * probs_sort[:, -1]).unsqueeze(1)
    logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, logits_sort)


def token_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(ids [N, k+1], logprobs [N, k+1]): each row's `token_ids` entry, then its k most likely tokens, with
    their logprobs under the log-softmax of the raw `logits` [N, V] (before temperature and filtering, as
    vLLM's default `raw_logprobs`). The sampled tokens' logprobs, and the prompt's."""
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(k, dim=-1)
    col = token_ids.unsqueeze(1)
    return torch.cat([col, top.indices], dim=1), torch.cat([logprobs.gather(1, col), top.values], dim=1)


def processed_probs(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The distribution each random row samples from: softmax(logits / temperature) over the tokens its top-k,
    top-p and min-p filters keep (a greedy row's, where the batch has random ones, at temperature 1)."""
    temperature = meta.temperature
    if not meta.all_random:
        temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits / temperature.unsqueeze(1)
    if not meta.no_top_p_top_k_min_p:
        logits = apply_top_k_top_p_min_p(logits, meta.top_k, meta.top_p, meta.min_p)
    return logits.softmax(dim=-1)


def greedy(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1) of float32 [B, V] logits; on the CPU through the native kernel."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0 and cpu_kernels_available():
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler(torch.nn.Module):
    """Picks one token per row of `logits` [B, V] and, when asked, the logprobs."""

    def forward(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        if meta.all_greedy:
            sampled = greedy(logits)
        else:
            sampled = self._sample_random(logits, meta)
            if not meta.all_random:
                sampled = torch.where(meta.temperature == 0, greedy(logits), sampled)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=None, logprobs=None)
        ids, values = token_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=values)

    @staticmethod
    def _sample_random(logits: Tensor, meta: SamplingMetadata) -> Tensor:
        return draw(processed_probs(logits, meta), meta, in_place=True)


def draw(probs: Tensor, meta: SamplingMetadata, in_place: bool = False) -> Tensor:
    """One token per row of `probs` [B, V] drawn from it: argmax(probs / E), E exponential (a seeded row's from its
    generator, the others' in one draw); `in_place` overwrites `probs`."""
    q = torch.empty_like(probs)
    if len(meta.generators) < q.shape[0]:
        q.exponential_()  # one draw for every unseeded row
    for row, generator in meta.generators.items():
        q[row].exponential_(generator=generator)
    return greedy(probs.div_(q) if in_place else probs / q)
