"""Speculative decoding in the engine (issue 42): greedy output with n-gram drafts is token for token the output
without them (and transformers'), under continuous batching with prefill chunks in the same steps, with preemption,
prefix caching, parallel sampling, stops and max_tokens inside an accepted run, and the compiled paths; drafts are
accepted (acceptance > 0) so the verification path is exercised, not skipped. The accept/reject rule's
distribution, the proposer and the config checks: tests/test_spec_decode_sampling.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from runner_core import ModelRunner, SamplingParams
from runner_core.sampling_params import StructuredOutputsParams
from tests.helpers import make_tiny_hf_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
BASE = {"dtype": "float32", "kv_cache_memory": 1 << 22, "max_model_len": 256}
# tiny-speaker (the trained preset) repeats itself: code and docstrings whose continuations copy the prompt
PROMPTS = ["def get(self, key):\n    return self.get(key)\ndef set(self, key):\n    return self.",
           "Return the list of the names. Return the list of the",
           "The function returns", "If the file"]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _runner(model: str, **fields) -> ModelRunner:
    return ModelRunner({"model": model, **BASE, **fields}).load_model()


@pytest.fixture(scope="module")
def plain():
    runner = _runner("tiny-speaker")
    yield runner
    runner.shutdown()


@pytest.fixture(scope="module")
def spec():
    runner = _runner("tiny-speaker", speculative_config=SPEC)
    yield runner
    runner.shutdown()


def _ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _accepted(runner) -> int:
    return runner.memory_stats()["spec_decoding"]["num_accepted_tokens"]


def test_greedy_output_is_the_output_without_speculation_and_drafts_are_accepted(plain, spec):
    before = _accepted(spec)
    outs = spec.generate(PROMPTS, GREEDY)
    assert _ids(outs) == _ids(plain.generate(PROMPTS, GREEDY))
    stats = spec.memory_stats()["spec_decoding"]
    assert stats["num_accepted_tokens"] > before and stats["acceptance_rate"] > 0.2, stats
    first = outs[0].metrics["spec_decoding"]
    assert first["num_accepted_tokens"] > 0 and first["mean_acceptance_length"] > 1
    assert first["num_accepted_tokens_per_pos"] == sorted(first["num_accepted_tokens_per_pos"], reverse=True)
    assert "spec_decoding" not in plain.generate(PROMPTS[:1], GREEDY)[0].metrics


def test_greedy_output_equals_transformers_on_a_tiny_random_model(tmp_path):
    """A 32-token vocabulary: the random model falls into loops, which the drafts copy."""
    path = make_tiny_hf_model(tmp_path, vocab_size=32, seed=0)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [3, 4, 11, 12] * 6, [11, 12, 13, 14, 15, 16, 17]]
    runner = _runner(str(path), speculative_config=SPEC)
    try:
        outs = runner.generate(prompts, GREEDY)
        assert _accepted(runner) > 0
    finally:
        runner.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected


def test_verification_shares_steps_with_prefill_chunks_under_continuous_batching(plain):
    """Requests arrive while others decode; a 24-token budget splits the prompts into chunks that run in the
    same steps as verified drafts (cut to what the budget leaves)."""
    runner = _runner("tiny-speaker", speculative_config=SPEC, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        engine, done = runner.engine, {}
        engine.add_request(PROMPTS[0], GREEDY, request_id="r0")
        for step in range(400):
            if step == 6:
                engine.add_request(PROMPTS[1] * 2, GREEDY, request_id="r1")
            if step == 9:
                engine.add_request(PROMPTS[2] * 3, GREEDY, request_id="r2")
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            if len(done) == 3:
                break
        mixed = [m for m in engine.step_metrics if m.num_spec_tokens and m.num_prefill_tokens]
        assert mixed, "no step verified drafts beside a prefill chunk"
        assert all(m.num_prefill_tokens + m.num_decode_tokens + m.num_spec_tokens <= 24 for m in engine.step_metrics)
    finally:
        runner.shutdown()
    expected = _ids(plain.generate([PROMPTS[0], PROMPTS[1] * 2, PROMPTS[2] * 3], GREEDY))
    assert [done["r0"], done["r1"], done["r2"]] == expected


def test_preemption_drops_the_drafts_and_the_output_is_unchanged(plain):
    """A 6-block pool (96 tokens) for four requests of about 70: the newest are preempted and recomputed."""
    per_token = plain.memory_stats()["kv_bytes_per_token"]
    runner = _runner("tiny-speaker", speculative_config=SPEC, kv_cache_memory=6 * 16 * per_token, max_model_len=96)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        outs = runner.generate(PROMPTS, params)
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        assert _accepted(runner) > 0
        assert runner.engine.memory.num_free_blocks == runner.engine.memory.num_blocks  # every block came back
    finally:
        runner.shutdown()
    assert _ids(outs) == _ids(plain.generate(PROMPTS, params))


def test_prefix_caching_keeps_only_accepted_tokens(plain):
    """Every cached block's tokens are a prefix of some request's final tokens (no rejected draft was ever
    hashed), and a second request on the first's prompt and output finds them and continues as without."""
    runner = _runner("tiny-speaker", speculative_config=SPEC, enable_prefix_caching=True, block_size=4)
    try:
        first = runner.generate(PROMPTS[:2], GREEDY)
        texts = [list(o.prompt_token_ids) + o.token_ids for o in first]
        pool = runner.engine.memory.pool
        cached = [b for b in pool.blocks if b.block_hash is not None]
        assert cached
        blocks = {tuple(t[i:i + 4]) for t in texts for i in range(0, len(t) - 3, 4)}
        assert all(b.key in blocks for b in cached)
        follow = [texts[0], texts[1]]
        second = runner.generate(follow, GREEDY)
        assert all(o.metrics["num_cached_prompt_tokens"] > 0 for o in second)
        assert _accepted(runner) > 0
    finally:
        runner.shutdown()
    assert _ids(second) == _ids(plain.generate(follow, GREEDY))


def test_max_tokens_and_stops_inside_an_accepted_run(plain, spec):
    """Cut at every length and at a stop token and a stop string met in the middle of the output: the output is
    the plain engine's, never a token past the stop or past max_tokens."""
    full = spec.generate(PROMPTS[0], GREEDY)[0]
    assert full.token_ids == plain.generate(PROMPTS[0], GREEDY)[0].token_ids
    for n in range(1, 20):
        cut = spec.generate(PROMPTS[0], GREEDY.replace(max_tokens=n))[0]
        assert cut.token_ids == full.token_ids[:n] and cut.finish_reason == "length", n
    i = 14  # a token met mid-output; its first occurrence is where the plain engine stops
    stop_id = full.token_ids[i]
    stopped = spec.generate(PROMPTS[0], GREEDY.replace(stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == plain.generate(PROMPTS[0], GREEDY.replace(stop_token_ids=[stop_id]))[0].token_ids
    assert stopped.token_ids[-1] == stop_id and stopped.finish_reason == "stop"
    word = full.text[len(full.text) // 2:][:6]
    with_stop = GREEDY.replace(stop=[word])
    out, expected = spec.generate(PROMPTS[0], with_stop)[0], plain.generate(PROMPTS[0], with_stop)[0]
    assert (out.text, out.token_ids, out.finish_reason) == (expected.text, expected.token_ids, "stop")


def test_parallel_sampling_forks_share_blocks_and_each_child_speculates(plain, spec):
    """n=3: the children copy the partial block on write and verify their own drafts; greedy children all give
    the plain engine's tokens, sampled ones run to their length."""
    params = GREEDY.replace(n=3)
    out = spec.generate(PROMPTS[1], params)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.generate(PROMPTS[1], params)[0].outputs]
    sampled = spec.generate(PROMPTS[1], SamplingParams(n=3, max_tokens=24, temperature=0.8, seed=3,
                                                       ignore_eos=True))[0]
    assert [len(c.token_ids) for c in sampled.outputs] == [24] * 3
    assert spec.engine.memory.num_free_blocks == spec.engine.memory.num_blocks


def test_structured_output_and_logprobs_requests_get_no_drafts_beside_others(plain, spec):
    regex = SamplingParams(max_tokens=16, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    logprobs = GREEDY.replace(logprobs=2)
    outs = spec.generate(PROMPTS[:3], [regex, logprobs, GREEDY])
    expected = plain.generate(PROMPTS[:3], [regex, logprobs, GREEDY])
    assert _ids(outs) == _ids(expected)
    assert "spec_decoding" not in outs[0].metrics and "spec_decoding" not in outs[1].metrics
    assert [sorted(d) for d in outs[1].logprobs] == [sorted(d) for d in expected[1].logprobs]


def test_reconfigure_turns_speculation_on_and_off(plain):
    runner = _runner("tiny-speaker")
    try:
        expected = _ids(plain.generate(PROMPTS[:2], GREEDY))
        result = runner.reconfigure(speculative_config=SPEC)
        assert result["changed"] == {"speculative_config": [None, SPEC]} and result["rebuilt"] == "scheduler"
        assert _ids(runner.generate(PROMPTS[:2], GREEDY)) == expected
        assert runner.memory_stats()["spec_decoding"]["num_accepted_tokens"] > 0
        runner.reconfigure(speculative_config={**SPEC, "num_speculative_tokens": 2})
        assert runner.memory_stats()["spec_decoding"]["num_speculative_tokens"] == 2
        runner.reconfigure(speculative_config=None)
        assert "spec_decoding" not in runner.memory_stats()
        assert _ids(runner.generate(PROMPTS[:2], GREEDY)) == expected
    finally:
        runner.shutdown()


def test_the_compiled_path_runs_verification_steps_on_the_general_program(compiled_tiny_llama):
    """Decode programs serve one token a sequence: a step with drafts takes the compiled general program."""
    runner = compiled_tiny_llama
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = _ids(runner.generate(prompts, params))
    runner.reconfigure(speculative_config={**SPEC, "prompt_lookup_min": 1})
    try:
        assert _ids(runner.generate(prompts, params)) == expected
        assert runner.memory_stats()["spec_decoding"]["num_drafts"] > 0
    finally:
        runner.reconfigure(speculative_config=None)
