"""Speculative decoding's parts (issue 42): the accept/reject rule leaves the output distribution the target's
(chi-square tests, fixed seeds, so they are deterministic), the n-gram lookup, and speculative_config's checks.
The engine with speculation: tests/test_spec_decode.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_core import ModelRunner, RunnerConfig, SamplingParams
from runner_core.errors import ConfigError
from runner_core.layers.sampler import SamplingMetadata, processed_probs
from runner_core.spec_decode import NgramProposer, RejectionSampler, SpeculativeConfig, ngram_lookup

V = 6
LOGITS = torch.tensor([1.0, 0.5, 0.2, -0.3, 0.8, -1.0])
N = 20000
CRITICAL = {5: 20.515, 2: 13.816}  # chi-square at alpha = 0.001 for df = 5 (6 tokens) and df = 2 (top-k 3)


def _chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the tokens' counts against N x p, over the tokens p gives mass to."""
    keep = p > 0
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[~keep].sum() == 0, "a token outside the distribution's support was emitted"
    expected = len(tokens) * p.double()[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def _emitted(params: SamplingParams, drafts: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple:
    """The token each of N rows emits at its one draft position (the draft if accepted, else the residual's
    draw), and the target's processed distribution p there."""
    logits = LOGITS.repeat(N, 1)
    meta = SamplingMetadata.build([params] * N, [None] * N, V, "cpu")
    out = RejectionSampler()(logits, drafts, [1] * N, meta, draft_probs)
    accepted = torch.tensor(out.num_accepted) == 1
    tokens = torch.where(accepted, drafts, torch.tensor(out.recovered))
    return tokens, processed_probs(LOGITS.unsqueeze(0), meta_one(params))[0], accepted


def meta_one(params: SamplingParams) -> SamplingMetadata:
    return SamplingMetadata.build([params], [None], V, "cpu")


@pytest.mark.parametrize("case", ["point mass", "draft distribution q", "top-k 3 and top-p"])
def test_the_emitted_token_follows_the_targets_distribution(case):
    """Chi-square goodness of fit of the token emitted at a draft position (the accepted draft, or the residual's
    draw after a rejection) against the target's processed distribution p (softmax(logits / 0.9), filtered where
    the case filters), N = 20,000 rows of one 6-token vocabulary, alpha = 0.001 (critical value 20.5 at 5 degrees
    of freedom, 13.8 at 2). The rows draw from torch's global generator seeded 0: the test is deterministic.
    Power (the noncentral chi-square, by simulation): 0.84 against moving 0.01 of probability between two tokens
    (p = 0.18 and 0.13; noncentrality 26); about 1 against a residual that keeps the rejected draft
    (noncentrality about 3000), the likely bug. Cases: the n-gram proposer's point-mass draft (q(x) = 1, the draft
    token 1 on every row); a draft model's q (drafts drawn from q, accepted with min(1, p/q), residual
    max(0, p - q)); top-k 3 with top-p 0.9 (the filtered p, whose zero-mass tokens must never be emitted)."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.9, max_tokens=1)
    draft_probs = None
    if case == "draft distribution q":
        q = torch.softmax(torch.tensor([0.0, 1.0, 0.3, 0.5, -0.5, 0.2]), 0)
        drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))
        draft_probs = q.repeat(N, 1)
    else:
        drafts = torch.full((N,), 1)
        if case == "top-k 3 and top-p":
            params = SamplingParams(temperature=0.9, top_k=3, top_p=0.9, max_tokens=1)
    tokens, p, accepted = _emitted(params, drafts, draft_probs)
    assert 0.05 < accepted.float().mean() < 0.95  # both branches of the rule are exercised
    df = int((p > 0).sum()) - 1
    assert _chi_square(tokens, p) < CRITICAL[df]


def test_greedy_rows_accept_while_the_draft_is_the_argmax_and_replace_the_first_mismatch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 5.0], [9.0, 0.0, 0.0]])
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, [None] * 2, 3, "cpu")
    # row 0: drafts 1, 0 (argmaxes 1, 0: both accepted); row 1: drafts 2 (argmax 2: accepted) then 1 (argmax 0)
    out = RejectionSampler()(logits, torch.tensor([1, 0, 2, 1]), [2, 2], meta)
    assert out.num_accepted == [2, 1] and out.recovered == [-1, 0]


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    """A seeded row's uniforms and residual draw come from its own generator (the rest of the batch aside)."""
    def run(rows: int) -> tuple:
        params = [SamplingParams(temperature=1.0, seed=5)] + [SamplingParams(temperature=1.0)] * (rows - 1)
        generators = [torch.Generator().manual_seed(5)] + [None] * (rows - 1)
        meta = SamplingMetadata.build(params, generators, V, "cpu")
        out = RejectionSampler()(LOGITS.repeat(3 * rows, 1), torch.full((3 * rows,), 5), [3] * rows, meta)
        return out.num_accepted[0], out.recovered[0]

    assert len({run(1), run(4), run(9)}) == 1


def test_ngram_lookup_takes_the_longest_then_the_most_recent_match():
    t = np.array([1, 2, 3, 9, 2, 3, 7, 8, 4, 2, 3])
    assert ngram_lookup(t, 3, 1, 2).tolist() == [7, 8]  # "2 3" most recently followed by 7 8
    t = np.array([1, 2, 3, 5, 6, 0, 3, 4, 4, 1, 2, 3])
    assert ngram_lookup(t, 3, 1, 3).tolist() == [5, 6, 0]  # "1 2 3" (3 tokens) beats the later "3"
    assert ngram_lookup(t, 1, 1, 3).tolist() == [4, 4, 1]  # 1-grams only: the latest "3"
    assert ngram_lookup(np.array([1, 2, 3, 4]), 3, 1, 2).tolist() == []  # the last token never occurred before
    assert ngram_lookup(np.array([7, 7, 7]), 4, 2, 5).tolist() == [7]  # runs up to the end of the history
    assert ngram_lookup(np.array([5, 1, 5, 2, 5]), 3, 2, 2).tolist() == []  # only 1-grams match, min is 2


def test_the_proposer_keeps_each_history_and_respects_limits():
    class Seq:
        def __init__(self, rid, ids):
            self.request_id, self.token_ids = rid, ids

    a, b = Seq("a", [1, 2, 3, 1, 2]), Seq("b", [4, 5, 4])
    proposer = NgramProposer(k=3, n_max=2, n_min=1)
    assert proposer.propose([a, b], [3, 3]) == [[3, 1, 2], [5, 4]]
    a.token_ids += [3, 9, 1, 2]
    assert proposer.propose([a, b], [1, 0]) == [[3], []]
    proposer.release("a")
    assert proposer.propose([a], [5]) == [[3, 9, 1]]


REFUSED = [
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"method 'draft_model' with 'model' None; allowed: a "
                                                              r"draft model's preset name or directory"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method 'eagle' is not implemented yet; allowed: method "
                                                       r"\"ngram\""),
    ({"method": "ngram", "model": "tiny-speaker-draft", "num_speculative_tokens": 2}, r"method 'ngram' with a "
                                                                                       r"draft 'model'"),
    ({"method": "medusa2", "num_speculative_tokens": 2}, r"method 'medusa2' is unknown; allowed: one of 'ngram'"),
    ({"method": "ngram"}, r"'num_speculative_tokens' is required"),
    ({"num_speculative_tokens": 0}, r"'num_speculative_tokens' got 0; allowed: an int from 1 to 16"),
    ({"num_speculative_tokens": 17}, r"got 17; allowed: an int from 1 to 16"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     r"prompt_lookup_min=3 exceeds prompt_lookup_max=2; allowed: prompt_lookup_min <= prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_mx": 2}, r"unknown key 'prompt_lookup_mx'"),
    ("ngram", r"got 'ngram'; allowed: None \(off\) or a dict"),
]


@pytest.mark.parametrize(("value", "message"), REFUSED, ids=[str(v) for v, _ in REFUSED])
def test_bad_speculative_configs_name_the_problem_and_the_fix(value, message):
    with pytest.raises(ConfigError, match=message):
        RunnerConfig(model="tiny-llama", speculative_config=value)


def test_speculative_config_is_normalised_and_unsupported_combinations_are_refused():
    config = RunnerConfig(model="tiny-llama", speculative_config={"num_speculative_tokens": 3})
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                         "prompt_lookup_min": 2}
    assert SpeculativeConfig.of(config).num_speculative_tokens == 3
    assert RunnerConfig(model="tiny-llama", speculative_config={"num_speculative_tokens": 1, "prompt_lookup_min": 6}
                        ).speculative_config["prompt_lookup_max"] == 6
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2: speculative decoding does not run over "
                                          r"pipeline stages yet"):
        RunnerConfig(model="tiny-llama", pipeline_parallel_size=2, speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="is set for a simulated runner: its steps draw tokens"):
        from runner_core.simulator import SimulatedRunner

        SimulatedRunner({"model": "tiny-llama", "speculative_config": {"num_speculative_tokens": 2}}).load_model()


def test_a_refused_reconfigure_leaves_speculation_off(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    try:
        with pytest.raises(ConfigError, match="'num_speculative_tokens' got 99"):
            runner.reconfigure(speculative_config={"num_speculative_tokens": 99})
        assert runner.config.speculative_config is None and runner.engine.spec is None
    finally:
        runner.shutdown()


def _chi_square_critical(df: int, z: float = 3.090) -> float:
    """The chi-square critical value at alpha = 0.001 (z: the normal's 0.999 quantile), Wilson-Hilferty's
    approximation (within 1% for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_output_through_the_engine_follows_the_same_distribution(tmp_path):
    """Two-sample chi-square (homogeneity) test of the sixth output token of 1,000 seeded requests at temperature
    0.6 with speculation (k = 3, prompt lookup from 1-grams, so most steps verify drafts: accepted ones, the
    residual's draws and bonus tokens all reach that position) against 1,000 without, on a 32-token random model;
    tokens with fewer than 5 expected per side are pooled, alpha = 0.001 (Wilson-Hilferty's critical value). Each
    request has its own seed (i), so the test is deterministic. Power (noncentral chi-square, about 20 bins): a
    shift of 0.06 of probability between two tokens of p = 0.1 (noncentrality about 36) is found with probability
    about 0.75; a wrong residual (the rejected draft kept: shifts of 0.1 and more) with about 1. The exact rule
    itself is tested against p with more samples above."""
    from tests.helpers import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, vocab_size=32, seed=0)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    base = {"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 24, "max_num_seqs": 256,
            "max_num_batched_tokens": 2048}
    samples = {}
    for name, spec in (("plain", None), ("spec", {"num_speculative_tokens": 3, "prompt_lookup_min": 1})):
        runner = ModelRunner({**base, "speculative_config": spec}).load_model()
        try:
            params = [SamplingParams(temperature=0.6, max_tokens=8, seed=i, ignore_eos=True) for i in range(1000)]
            samples[name] = torch.tensor([o.token_ids[5] for o in runner.generate([prompt] * 1000, params)])
            if spec is not None:
                assert runner.memory_stats()["spec_decoding"]["num_accepted_tokens"] > 50
        finally:
            runner.shutdown()
    stat, critical, table = homogeneity(samples["plain"], samples["spec"], 32)
    assert stat < critical, (stat, table)


def homogeneity(a: torch.Tensor, b: torch.Tensor, vocab: int) -> tuple[float, float, torch.Tensor]:
    """(the two-sample chi-square statistic of token samples `a` and `b`, its critical value at alpha = 0.001,
    the table): tokens with fewer than 5 expected per side pooled."""
    counts = torch.stack([torch.bincount(x, minlength=vocab) for x in (a, b)]).double()
    small = counts.sum(0) / 2 < 5
    table = torch.cat([counts[:, ~small], counts[:, small].sum(1, keepdim=True)], 1) if small.any() else counts
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), _chi_square_critical(table.shape[1] - 1), table
