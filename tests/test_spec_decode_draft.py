"""Speculative decoding with a draft model (engine/draft_model.py): greedy output token for token the plain
engine's, real acceptance on the shipped pair (tiny-speaker and tiny-speaker-draft), sampling at temperature > 0
with the draft's q, preemption in a small pool (the draft's blocks freed and its KV rebuilt), the draft counted by
the memory estimate, and the combinations refused."""

import pytest
import torch

from runner_core import ModelRunner
from runner_core.config import RunnerConfig
from runner_core.errors import ConfigError
from runner_core.memory import estimate_memory
from runner_core.sampling_params import SamplingParams

BASE = {"model": "tiny-speaker", "dtype": "float32", "kv_cache_memory": 1 << 22, "max_num_seqs": 8}
DRAFT = {"model": "tiny-speaker-draft", "num_speculative_tokens": 3}
PROMPTS = ["The function returns", "This module provides", "If the file", "Return the", "The default value is",
           "Raise an exception if"]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _tokens(fields: dict, prompts=PROMPTS, params=GREEDY) -> tuple[list[list[int]], dict]:
    runner = ModelRunner({**BASE, **fields}).load_model()
    try:
        out = [o.outputs[0].token_ids for o in runner.generate(prompts, params)]
        return out, runner.memory_stats().get("spec_decoding", {})
    finally:
        runner.shutdown()


@pytest.fixture(scope="module")
def plain():
    return _tokens({})[0]


def test_greedy_output_equals_the_plain_engine_and_the_draft_is_accepted(plain):
    out, stats = _tokens({"speculative_config": DRAFT})
    assert out == plain
    assert stats["method"] == "draft_model" and stats["model"] == "tiny-speaker-draft"
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0
    assert stats["acceptance_rate"] > 0.2  # the trained pair agrees often (about 0.4-0.5 at k=3)
    assert stats["draft_kv_free_blocks"] == stats["draft_kv_blocks"]  # every finished request freed its blocks


def test_preemption_with_a_draft_model_frees_and_rebuilds_the_draft_kv(plain):
    # 12 blocks of 16 tokens for 6 sequences of ~37 tokens: sequences are preempted and recomputed
    small = {"kv_cache_memory": 12 * 16 * 2 * 4 * 128 * 4 + 12 * 16 * 2 * 2 * 64 * 4, "max_model_len": 64}
    runner = ModelRunner({**BASE, **small, "speculative_config": DRAFT}).load_model()
    try:
        assert runner.engine.memory.num_blocks == runner.engine.spec.proposer.memory.num_blocks == 12
        out = [o.outputs[0].token_ids for o in runner.generate(PROMPTS, GREEDY)]
        assert sum(r.num_preempted for r in runner.engine.step_metrics) > 0
        stats = runner.memory_stats()["spec_decoding"]
    finally:
        runner.shutdown()
    assert out == plain
    assert stats["num_accepted_tokens"] > 0 and stats["draft_kv_free_blocks"] == 12


def test_an_aborted_request_frees_its_draft_blocks():
    runner = ModelRunner({**BASE, "speculative_config": DRAFT}).load_model()
    try:
        engine = runner.engine
        draft = engine.spec.proposer.memory
        engine.add_request(PROMPTS[0], GREEDY, request_id="a")
        engine.add_request(PROMPTS[1], GREEDY, request_id="b")
        for _ in range(3):
            engine.step()
        held = draft.num_blocks - draft.num_free_blocks
        assert held > 0
        engine.abort_request("a")
        assert draft.num_blocks - draft.num_free_blocks < held
        while engine.has_unfinished_requests():
            engine.step()
        assert draft.num_free_blocks == draft.num_blocks
    finally:
        runner.shutdown()


def test_a_prompt_longer_than_the_token_budget_reaches_the_draft_in_pieces():
    long = " ".join(PROMPTS) + " and the value of the file is returned to the caller of the function"
    fields = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
    plain, _ = _tokens(fields, [long, PROMPTS[0]])
    out, stats = _tokens({**fields, "speculative_config": DRAFT}, [long, PROMPTS[0]])
    assert out == plain and stats["num_accepted_tokens"] > 0


def test_sampling_with_the_draft_q_runs_and_accepts():
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
    out, stats = _tokens({"speculative_config": DRAFT}, PROMPTS[:4], params)
    assert all(len(o) == 24 for o in out)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_sampled_output_with_a_draft_model_follows_the_same_distribution(tmp_path):
    """Two-sample chi-square tests (test_spec_decode_sampling.homogeneity, alpha = 0.001 each) of the second and
    third output tokens (the first verified positions: draft 1, draft 2, their residual draws, bonus tokens) of
    1,000 seeded requests at temperature 0.8 with a draft model (another random model of the same 32-token
    vocabulary, k = 3, whose q is far from p: top tokens differ, max q 0.57 against max p 0.25) against 1,000
    without. Deterministic (each request seeded). Power, measured: the rule fed a wrong q (uniform) gives
    statistics of about 280 and 170 against critical values about 60; the correct rule about 30."""
    from tests.helpers import make_tiny_hf_model
    from tests.test_spec_decode_sampling import homogeneity

    target = make_tiny_hf_model(tmp_path, vocab_size=32, seed=0)
    draft = make_tiny_hf_model(tmp_path, vocab_size=32, seed=1)
    base = {"model": str(target), "dtype": "float32", "kv_cache_memory": 1 << 22, "max_num_seqs": 128}
    params = [SamplingParams(temperature=0.8, max_tokens=4, seed=i, ignore_eos=True) for i in range(1000)]
    samples = {}
    for name, spec in (("plain", None), ("draft", {"model": str(draft), "num_speculative_tokens": 3})):
        runner = ModelRunner({**base, "speculative_config": spec}).load_model()
        try:
            samples[name] = torch.tensor([o.token_ids for o in runner.generate([[5, 6, 7, 8]] * 1000, params)])
            if spec is not None:
                stats = runner.memory_stats()["spec_decoding"]
                assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
        finally:
            runner.shutdown()
    for position in (1, 2):
        stat, critical, table = homogeneity(samples["plain"][:, position], samples["draft"][:, position], 32)
        assert stat < critical, (position, stat, table)


def test_the_memory_estimate_counts_the_draft():
    plain = estimate_memory("tiny-speaker", dtype="float32", kv_cache_memory=1 << 22)
    with_draft = estimate_memory("tiny-speaker", dtype="float32", kv_cache_memory=1 << 22,
                                 draft_model="tiny-speaker-draft")
    assert with_draft.draft_weights_bytes > 0 and with_draft.draft_kv_bytes_per_token == 2 * 2 * 64 * 4
    assert with_draft.weights_bytes == plain.weights_bytes + with_draft.draft_weights_bytes
    assert with_draft.kv_bytes_per_token == plain.kv_bytes_per_token + with_draft.draft_kv_bytes_per_token
    assert with_draft.kv_pool_tokens < plain.kv_pool_tokens  # the same budget split between the two pools
    assert with_draft.kv_pool_bytes <= 1 << 22


def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ConfigError, match=r"the draft model 'tiny-llama' has another vocabulary than the target "
                                          r"\(512 ids against 2048"):
        ModelRunner({**BASE, "speculative_config": {"model": "tiny-llama", "num_speculative_tokens": 2}}).load_model()


def test_parallel_layouts_and_live_draft_changes_are_refused():
    with pytest.raises(ConfigError, match="a draft model runs in one process only"):
        RunnerConfig(model="tiny-speaker", tensor_parallel_size=2, speculative_config=DRAFT)
    assert RunnerConfig(model="tiny-speaker", speculative_config={"method": "model", "model": "tiny-speaker-draft",
                                                                  "num_speculative_tokens": 2}
                        ).speculative_config["method"] == "draft_model"
    runner = ModelRunner(BASE).load_model()
    try:
        with pytest.raises(ConfigError, match="cannot add, change or drop a draft model on a loaded runner"):
            runner.reconfigure(speculative_config=DRAFT)
        assert runner.engine.spec is None
    finally:
        runner.shutdown()
