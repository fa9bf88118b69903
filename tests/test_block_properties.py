"""Property tests over random request streams: no block leaks, no block owned twice,
block tables always match what each sequence has computed."""

from __future__ import annotations

import random
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
abort = st.none() | st.tuples(st.integers(1, 6), st.integers(0, 7))  # (step, which live request)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(request, min_size=1, max_size=8), abort, st.integers(0, 2**16))
def test_random_request_streams_keep_the_pool_consistent(runner, requests, abort_at, seed):
    """Everything random is drawn up front, so the example does not depend on engine state."""
    engine = runner.engine
    assert not runner.has_unfinished_requests()
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(3, 512) for _ in range(plen)] for plen, _, _ in requests]
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    step, finished, aborted, ids = 0, {}, set(), {}
    while pending or runner.has_unfinished_requests():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            params = SamplingParams(max_tokens=requests[i][1], temperature=0.0, ignore_eos=True)
            ids[runner.add_request(prompts[i], params)] = i
        for out in runner.step():
            if out.finished:
                finished[out.request_id] = out
        if abort_at and step == abort_at[0] and engine.requests:  # cancel one mid-flight
            live = sorted(engine.requests)
            rid = live[abort_at[1] % len(live)]
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
