"""Property tests over random request streams: no block leaks, no block owned twice,
block tables always match what each sequence has computed, and the worker's persistent block
tables always match rank 0's, though each step sends only the entries they lack."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner_core import ModelRunner, SamplingParams, faults

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
    check_worker_block_table(engine)


def check_worker_block_table(engine) -> None:
    """The worker's BlockTable holds every entry rank 0 sent, zeros past them, and rows only for live
    requests or those whose release the next batch carries."""
    table = engine.worker.forward_pass.buffers.block_table
    for rid, seq in engine.requests.items():
        if seq.num_sent_blocks:
            row = table.rows[rid]
            assert table.num_blocks[row] == seq.num_sent_blocks
            assert table.table[row, : seq.num_sent_blocks].tolist() == seq.block_table[: seq.num_sent_blocks]
            assert not table.table[row, seq.num_sent_blocks:].any()
    assert set(table.rows) <= set(engine.requests) | set(engine._freed)


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


def test_each_block_id_goes_to_the_workers_once(runner):
    """With no preemption, every block a request holds crosses to the workers once, in order: a step
    sends only the entries the workers' block tables lack (most decode steps send none)."""
    engine = runner.engine
    batches = []
    with faults.inject("forward", lambda batch: batches.append(batch) or batch):
        outs = runner.generate([[5] * 6, [7] * 9, [9] * 3], SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))
    assert all(o.metrics["num_preemptions"] == 0 for o in outs)
    sent = {}
    for batch in batches:
        for rid, first, ids in batch.new_blocks:
            assert first == len(sent.setdefault(rid, []))  # each entry once, in order
            sent[rid] += ids
    for out in outs:  # the last sampled token is never computed: prompt + 11 tokens in the pool
        assert len(sent[out.request_id]) == engine.memory.blocks_for(len(out.prompt_token_ids) + 11)
    decodes = [b for b in batches if b.num_prefill_tokens == 0]
    assert decodes and any(not b.new_blocks for b in decodes)


def test_block_table_rows_by_request():
    """Entries are written where they belong, a freed request's row goes (and is reused zeroed), a
    readmitted request's shorter table cuts its row, the same entries sent twice change nothing, a
    defragmentation renumbers the ids in place, and entries that would leave a gap are refused."""
    from runner_core.engine.input_batch import BlockTable

    table = BlockTable(max_rows=2, max_blocks=6)
    rows = table.update([], [("a", 0, [3, 4]), ("b", 0, [7])], ["b", "a"])
    assert rows == [table.rows["b"], table.rows["a"]] and BlockTable.ZERO_ROW not in rows
    table.update([], [("a", 2, [9]), ("a", 2, [9])])  # a decode's new block, and the same sent again
    assert table.table[table.rows["a"]].tolist() == [3, 4, 9, 0, 0, 0] and table.num_blocks[table.rows["a"]] == 3
    row_b = table.rows["b"]
    table.update(["b", "never-sent"], [("c", 0, [5, 6])])  # b's row goes; c takes it, zeroed
    assert "b" not in table.rows and table.rows["c"] == row_b and table.table[row_b].tolist() == [5, 6, 0, 0, 0, 0]
    table.update([], [("a", 0, [1])])  # a was preempted and readmitted with a shorter table
    assert table.table[table.rows["a"]].tolist() == [1, 0, 0, 0, 0, 0] and table.num_blocks[table.rows["a"]] == 1
    table.update([], [("d", 0, [2])])  # more rows than planned: the table grows
    table.move({5: 0, 6: 3})
    assert table.table[table.rows["c"]].tolist() == [0, 3, 0, 0, 0, 0] and not table.table[BlockTable.ZERO_ROW].any()
    with pytest.raises(RuntimeError, match="'a' has 1 block-table entries on this rank, yet its entries from 3"):
        table.update([], [("a", 3, [8])])
    with pytest.raises(RuntimeError, match="request 'e' has no block table on this rank"):
        table.update([], [], ["e"])
