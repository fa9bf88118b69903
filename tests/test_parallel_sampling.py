"""Parallel sampling (`SamplingParams.n`, `best_of`): the prompt prefilled once and forked over shared KV blocks
(reference counts; a shared partial block copied on first write), each child's tokens those of an n=1 request
with its seed (so the shared KV is not corrupted), each child's first token drawn from the n=1 distribution,
best_of's ranking, preemption with prefix caching on and off, chunked prefill, structured outputs, refusals."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from runner_core import InvalidRequestError, ModelRunner, SamplingParams, StructuredOutputsParams

BYTES_PER_BLOCK = 16 * 4 * 2 * 2 * 32 * 4  # tiny-llama, float32: 16 tokens x 4 layers x K,V x 2 heads x 32 dims
SAMPLED = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22, **kw}).load_model()


def _prompt(n: int, seed: int = 5) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    r = _runner(tiny_llama_path, max_model_len=640)
    yield r
    r.shutdown()


def _used(engine) -> int:
    return engine.memory.num_blocks - engine.memory.num_free_blocks


def _step_until_forked(engine, request_id: str, n: int) -> None:
    while sum(rid == request_id or rid.startswith(request_id + "#") for rid in engine.requests) < n:
        engine.step()


def test_n4_shares_the_prompt_blocks_copies_the_partial_one_and_frees_them(runner):
    engine, prompt = runner.engine, _prompt(500)  # 31 full blocks and a partial one of 4 tokens
    bs = engine.memory.block_size
    engine.add_request(prompt, SamplingParams(n=4, seed=1, **SAMPLED), request_id="g")
    _step_until_forked(engine, "g", 4)
    prompt_blocks = -(-len(prompt) // bs)
    assert _used(engine) == prompt_blocks  # the end of the prompt: its blocks alone, shared by the four
    tables = [engine.requests[rid].block_table for rid in ("g", "g#1", "g#2", "g#3")]
    assert all(t == tables[0] for t in tables)
    assert all(engine.memory.ref_counts[b] == 4 for b in tables[0])
    assert len(engine.kv_block_map()["shared"]) == prompt_blocks
    # the shared partial block's empty slots count once: the pool holds the prompt once
    assert runner.memory_stats()["kv_utilization"] == pytest.approx(len(prompt) / (prompt_blocks * bs))
    engine.step()  # each child writes its first token into the partial block: three copy it, the last keeps it
    tables = [engine.requests[rid].block_table for rid in ("g", "g#1", "g#2", "g#3")]
    assert _used(engine) == prompt_blocks + 3
    assert len({t[-1] for t in tables}) == 4 and all(t[:-1] == tables[0][:-1] for t in tables)
    assert all(engine.memory.ref_counts[b] == 4 for b in tables[0][:-1])
    assert all(engine.memory.ref_counts[t[-1]] == 1 for t in tables)
    shared = engine.kv_block_map()["shared"]
    assert set(shared) == set(tables[0][:-1]) and sorted(shared[tables[0][0]]) == ["g", "g#1", "g#2", "g#3"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.memory.num_free_blocks == engine.memory.num_blocks and not engine.groups


def test_greedy_children_equal_n1_greedy(runner):
    prompt = _prompt(37, seed=2)  # a partial last block, shared, then copied
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    one = runner.generate(prompt, SamplingParams(**greedy))[0]
    out = runner.generate(prompt, SamplingParams(n=3, **greedy))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == one.token_ids and c.text == one.text for c in out.outputs)
    assert out.token_ids == one.token_ids


@pytest.mark.parametrize("options", [{}, {"enable_prefix_caching": True},
                                     {"max_num_batched_tokens": 16, "max_num_seqs": 8}],
                         ids=["plain", "prefix-caching", "chunked-prefill"])
def test_each_child_gives_the_tokens_of_an_n1_request_with_its_seed(tiny_llama_path, options):
    runner = _runner(tiny_llama_path, max_model_len=256, **options)
    prompt = _prompt(45, seed=3)
    out = runner.generate(prompt, SamplingParams(n=4, seed=11, **SAMPLED))[0]
    singles = runner.generate([prompt] * 4, [SamplingParams(seed=11 + i, **SAMPLED) for i in range(4)])
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert runner.memory_stats()["blocks_free"] == runner.memory_stats()["blocks_total"]
    runner.shutdown()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_children_recompute_their_own_tokens(tiny_llama_path, prefix_caching):
    """A pool of 10 blocks for four children of a 3-block prompt growing to 5 blocks each: children are
    preempted one at a time and resumed from their prompt and their own tokens."""
    prompt, params = _prompt(40, seed=4), SamplingParams(n=4, seed=21, temperature=1.0, max_tokens=40,
                                                         ignore_eos=True)
    expected = _runner(tiny_llama_path, max_model_len=128).generate(prompt, params)[0]
    runner = _runner(tiny_llama_path, kv_cache_memory=10 * BYTES_PER_BLOCK, max_model_len=128,
                     enable_prefix_caching=prefix_caching)
    out = runner.generate(prompt, params)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]
    assert out.metrics["num_preemptions"] > 0
    assert runner.memory_stats()["blocks_free"] == 10
    runner.shutdown()


def test_first_tokens_of_the_children_follow_the_n1_distribution(runner):
    """Temperature 1 over a near-uniform tiny model: 1024 first tokens of children (32 requests, n=32) and 1024
    of n=1 requests, binned into 8 bins of equal probability under the model's own distribution; each
    sample's chi-square against it and the two samples' against each other stay under the 0.001 critical
    value, and the children of one request are independent (their equal pairs as often as sum(p^2) says).
    Seeds are fixed: the draws are the same every run."""
    prompt, first = _prompt(20, seed=6), {"temperature": 1.0, "max_tokens": 1, "ignore_eos": True}
    probs = runner.engine.forward_stateless([prompt])[1][-1].double().softmax(-1)
    groups = runner.generate([prompt] * 32, [SamplingParams(n=32, seed=1000 * j, **first) for j in range(32)])
    children = [c.token_ids[0] for g in groups for c in g.outputs]
    singles = [o.token_ids[0] for o in runner.generate(
        [prompt] * 1024, [SamplingParams(seed=10**6 + k, **first) for k in range(1024)])]
    order = probs.argsort(descending=True)
    bin_of = torch.empty(len(probs), dtype=torch.long)
    bin_of[order] = (probs[order].cumsum(0) * 8).clamp(max=7.999).long()  # 8 bins of ~1/8 of the mass each
    mass = torch.zeros(8, dtype=torch.float64).index_add_(0, bin_of, probs)

    def counts(tokens):
        return torch.bincount(bin_of[torch.tensor(tokens)], minlength=8).double()

    def chi2(observed, expected):
        return float(((observed - expected) ** 2 / expected).sum())

    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    a, b = counts(children), counts(singles)
    assert chi2(a, 1024 * mass) < critical and chi2(b, 1024 * mass) < critical
    assert chi2(a, (a + b) / 2) + chi2(b, (a + b) / 2) < critical  # two samples, one distribution
    pairs = sum(math.comb(k, 2) for g in groups for k in Counter(c.token_ids[0] for c in g.outputs).values())
    expected_pairs = 32 * math.comb(32, 2) * float((probs ** 2).sum())
    assert expected_pairs / 2 < pairs < expected_pairs * 2


def test_best_of_keeps_the_n_with_the_highest_cumulative_logprob(runner):
    prompt = _prompt(30, seed=7)
    params = {"seed": 3, "temperature": 1.0, "max_tokens": 12, "ignore_eos": True}
    best = runner.generate(prompt, SamplingParams(n=2, best_of=6, **params))[0]
    every = runner.generate(prompt, SamplingParams(n=6, logprobs=0, **params))[0]
    for c in every.outputs:
        assert math.isclose(c.cumulative_logprob, sum(e[t] for t, e in zip(c.token_ids, c.logprobs)), rel_tol=1e-5)
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1] and all(c.logprobs is None for c in best.outputs)
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_streamed_children_add_up_to_their_final_text(runner):
    prompt, params = _prompt(20, seed=8), SamplingParams(n=3, seed=5, **SAMPLED)
    pieces, ids, last = {}, {}, None
    for delta in runner.stream(prompt, params):
        pieces[delta.index] = pieces.get(delta.index, "") + delta.text
        ids.setdefault(delta.index, []).extend(delta.token_ids)
        last = delta
    assert last.finished and sorted(pieces) == [0, 1, 2]
    final = runner.generate(prompt, params)[0]
    assert [ids[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert [pieces[i] for i in range(3)] == [c.text for c in final.outputs]


def test_aborting_a_group_ends_every_child_and_frees_the_blocks(runner):
    engine = runner.engine
    engine.add_request(_prompt(40), SamplingParams(n=3, **SAMPLED), request_id="ab", stream=True)
    _step_until_forked(engine, "ab", 3)
    engine.step()
    out = engine.abort_request("ab")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) == 2 for c in out.outputs)
    assert not engine.requests and not engine.groups and not engine.has_unfinished_requests()
    assert engine.memory.num_free_blocks == engine.memory.num_blocks


def test_each_child_has_its_own_structured_output_matcher(runner):
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])
    out = runner.generate("pick: ", SamplingParams(n=4, seed=9, temperature=1.0, max_tokens=20,
                                                   structured_outputs=choice))[0]
    assert len(out.outputs) == 4 and all(c.text in choice.choice for c in out.outputs)


@pytest.mark.parametrize("params, message", [
    ({"n": 0}, "SamplingParams.n got 0"),
    ({"n": 3, "best_of": 2}, "best_of got 2; allowed: None or an int >= n=3"),
    ({"n": 300}, "max_num_seqs is 256; lower n or raise max_num_seqs"),
])
def test_bad_n_and_best_of_are_refused_naming_the_fix(runner, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        runner.generate("x", SamplingParams(**params))


def test_best_of_above_n_does_not_stream(runner):
    with pytest.raises(InvalidRequestError, match="cannot stream"):
        next(runner.stream("x", SamplingParams(n=1, best_of=2)))
