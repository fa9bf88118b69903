"""RejectionSampler (vLLM's name): which of a step's draft tokens the target model accepts, and the token that
replaces the first rejected one — speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"), written here from the papers' rule.

At each draft position j of a row, p_j is the target's distribution there as the Sampler would sample from it
(temperature, top-k, top-p, min-p applied: `processed_probs`) and q_j the draft's. Draft x_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); the first rejected position's token is drawn from the residual
max(0, p_j - q_j), renormalised; when every draft is accepted, the row's bonus token is drawn from the next
position's p (the Sampler's ordinary sample of the row's last position, made by the engine). Each emitted token is
then distributed exactly as p: the output distribution is the target's, whatever the draft. A prompt-lookup draft
is a point mass (q_j(x_j) = 1, `draft_probs` None): accept with probability p_j(x_j), else draw from p_j with
x_j removed. Greedy rows (temperature 0) accept a draft exactly when it is the argmax of the target's logits, and
the first mismatch's argmax replaces it: greedy output is token for token the output without speculation.

Random draws: a seeded row (SamplingParams.seed) takes its uniforms and its residual draw from its own generator,
so its tokens depend on its own drafts only, never on the rest of the batch; an unseeded row shares one batched
draw. The draws are consumed differently from a step without speculation (one uniform per draft, an exponential
per vocabulary entry for a residual draw, on top of the Sampler's draw for the bonus token), so a seeded
request's sampled output with speculation differs from its output without (both follow the same distribution),
and with speculation it is reproducible only while the same drafts are verified: the drafts a step verifies
depend on the token budget the rest of the batch leaves (`Scheduler.schedule`). Greedy output is identical in
every case.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from runner_core.layers.sampler import SamplingMetadata, greedy, processed_probs


@dataclasses.dataclass
class RejectionOutput:
    num_accepted: list[int]  # per row: its drafts accepted, a prefix
    recovered: list[int]  # per row: the token drawn at its first rejected position; -1 where all were accepted


def per_position(meta: SamplingMetadata, row_of: Tensor) -> SamplingMetadata:
    """`meta` (one entry per row) repeated for each draft position (`row_of`: each position's row); generators
    are left out (the rejection sampler draws per row)."""
    return dataclasses.replace(meta, temperature=meta.temperature[row_of], top_p=meta.top_p[row_of],
                               top_k=meta.top_k[row_of], min_p=meta.min_p[row_of], generators={})


class RejectionSampler:
    """Accepts a prefix of each row's drafts and draws the token at its first rejection."""

    def __call__(self, logits: Tensor, draft_token_ids: Tensor, num_drafts: list[int], meta: SamplingMetadata,
                 draft_probs: Tensor | None = None) -> RejectionOutput:
        """`logits` [K, V] float32: the target's logits at every draft position, each row's `num_drafts` (>= 1)
        positions in turn (position j scores draft j); `draft_token_ids` [K]; `meta`: the rows' sampling settings
        (one entry per row); `draft_probs` [K, V]: the draft's distributions, None for point masses."""
        device = logits.device
        rows, counts = len(num_drafts), torch.tensor(num_drafts, device=device)
        row_of = torch.repeat_interleave(torch.arange(rows, device=device), counts)
        offsets = torch.cumsum(counts, 0) - counts
        argmax = None if meta.all_random else greedy(logits)
        probs = None
        if meta.all_greedy:
            accepted = draft_token_ids == argmax
        else:
            probs = processed_probs(logits, per_position(meta, row_of))
            target = probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
            if draft_probs is not None:  # min(1, p/q) is compared with u < 1: the min changes nothing
                target = target / draft_probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
            accepted = self._uniforms(meta, num_drafts, offsets, device) < target
            if argmax is not None:
                accepted = torch.where(meta.temperature[row_of] == 0, draft_token_ids == argmax, accepted)
        # each row's accepted prefix: the leading run of accepted positions
        grid = torch.zeros(rows, int(counts.max()) + 1, dtype=torch.int64, device=device)
        grid[row_of, torch.arange(len(row_of), device=device) - offsets[row_of]] = accepted.long()
        num_accepted = grid.cumprod(dim=1).sum(dim=1)
        recovered = torch.full((rows,), -1, dtype=torch.int64, device=device)
        rejected = (num_accepted < counts).nonzero().flatten()
        if rejected.numel():
            at = offsets[rejected] + num_accepted[rejected]  # the first rejected position of each such row
            recovered[rejected] = self._recover(logits, probs, argmax, draft_token_ids, draft_probs, meta, rejected, at)
        return RejectionOutput(num_accepted.tolist(), recovered.tolist())

    @staticmethod
    def _uniforms(meta: SamplingMetadata, num_drafts: list[int], offsets: Tensor, device) -> Tensor:
        """One uniform per draft position: a seeded row's from its generator, the others' in one draw."""
        u = torch.rand(sum(num_drafts), device=device)
        for row, generator in meta.generators.items():
            start = int(offsets[row])
            u[start:start + num_drafts[row]] = torch.rand(num_drafts[row], generator=generator, device=device)
        return u

    @staticmethod
    def _recover(logits: Tensor, probs: Tensor | None, argmax: Tensor | None, drafts: Tensor,
                 draft_probs: Tensor | None, meta: SamplingMetadata, rows: Tensor, at: Tensor) -> Tensor:
        """The token replacing each rejected draft (rows `rows`, positions `at`): a greedy row's argmax, a random
        row's draw from the residual max(0, p - q) (p with the draft removed for a point mass)."""
        if probs is None:  # every row greedy
            return argmax[at]
        residual = probs[at]
        if draft_probs is None:
            residual.scatter_(1, drafts[at].unsqueeze(1), 0.0)
        else:
            residual = (residual - draft_probs[at]).clamp_(min=0.0)
        empty = residual.sum(dim=1, keepdim=True) <= 0  # p was all on the draft (rounding): draw from p
        residual = torch.where(empty, probs[at], residual)
        noise = torch.empty_like(residual).exponential_()  # the exponential race: argmax(r / E) is a draw from r
        for i, row in enumerate(rows.tolist()):
            generator = meta.generators.get(row)
            if generator is not None:
                noise[i].exponential_(generator=generator)
        drawn = greedy(residual.div_(noise))
        if argmax is not None:
            drawn = torch.where(meta.temperature[rows] == 0, argmax[at], drawn)
        return drawn
