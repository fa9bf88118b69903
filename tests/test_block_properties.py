"""Property tests over random request streams: no block leaks, no block owned twice,
block tables always match what each sequence has computed."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner_core import ModelRunner, SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny-llama: layers x (K, V) x kv_heads x head_dim x fp32


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "block_size": BLOCK_SIZE,
                        "kv_cache_memory": NUM_BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN, "max_model_len": 64,
                        "max_num_seqs": 5, "max_num_batched_tokens": 24}).load_model()


def check_invariants(engine) -> None:
    mem = engine.memory
    owners = Counter(b for seq in engine.requests.values() for b in seq.block_table)
    assert all(c == 1 for c in owners.values()), "a block is owned twice"
    assert set(owners).isdisjoint(mem.free_block_ids), "an owned block is also free"
    assert len(owners) + mem.num_free_blocks == mem.num_blocks, "a block leaked"
    assert len(set(mem.free_block_ids)) == len(mem.free_block_ids)
    for seq in engine.requests.values():
        assert len(seq.block_table) == mem.blocks_for(seq.num_computed_tokens)
        assert mem.ref_counts.count(0) == mem.num_free_blocks


request = st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 3))  # prompt len, max_tokens, arrival step


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(request, min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_random_request_streams_keep_the_pool_consistent(runner, requests, rnd):
    engine = runner.engine
    pending = sorted(enumerate(requests), key=lambda x: x[1][2])
    step, finished, aborted = 0, {}, set()
    ids = {}
    while pending or runner.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (plen, max_tokens, _) = pending.pop(0)
            prompt = [rnd.randrange(3, 512) for _ in range(plen)]
            ids[runner.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))] = i
        for out in runner.step():
            if out.finished:
                finished[out.request_id] = out
        if step == 2 and engine.requests and rnd.random() < 0.3:  # cancel one mid-flight
            rid = rnd.choice(sorted(engine.requests))
            runner.abort_request(rid)
            aborted.add(rid)
        check_invariants(engine)
        step += 1
        assert step < 2000
    assert engine.memory.num_free_blocks == NUM_BLOCKS
    for rid, i in ids.items():
        if rid not in aborted:
            assert finished[rid].finish_reason == "length"
            assert len(finished[rid].token_ids) == min(requests[i][1], 64 - requests[i][0])
