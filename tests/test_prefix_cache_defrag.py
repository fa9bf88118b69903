"""Prefix caching (reuse, sharing, eviction, verification) and defragmentation / shrinking of the
KV pool, each leaving the generated tokens exactly as they are without it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner_core import InvalidRequestError, ModelRunner, SamplingParams
from runner_core.memory import block_pool

BS = 8
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny-llama, fp32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _runner(path, blocks=256, **kw) -> ModelRunner:
    return ModelRunner({"model": str(path), "dtype": "float32", "block_size": BS, "max_model_len": 256,
                        "kv_cache_memory": blocks * BS * BYTES_PER_TOKEN, **kw}).load_model()


def _tokens(seed, n):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 512) for _ in range(n)]


SYSTEM = _tokens(0, 40)
PROMPTS = [SYSTEM + _tokens(i, 5 + i) for i in range(1, 6)]


@pytest.fixture(scope="module")
def expected(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    return [o.token_ids for o in runner.generate(PROMPTS, GREEDY)]


def _all_free(runner) -> bool:
    pool = runner.engine.memory.pool
    return all(b.ref_count == 0 for b in pool.blocks) and pool.num_free == pool.num_blocks


def test_identical_prompt_hits_the_cache(tiny_llama_path, expected):
    runner = _runner(tiny_llama_path, enable_prefix_caching=True)
    first = runner.generate(PROMPTS[0], GREEDY)[0]
    second = runner.generate(PROMPTS[0], GREEDY)[0]
    assert first.token_ids == second.token_ids == expected[0]
    assert first.metrics["num_cached_prompt_tokens"] == 0
    assert second.metrics["num_cached_prompt_tokens"] == (len(PROMPTS[0]) - 1) // BS * BS
    assert runner.memory_stats()["prefix_cache_hit_rate"] > 0.4
    assert _all_free(runner) and runner.memory_stats()["blocks_cached"] > 0


def test_shared_system_prompt_is_reused(tiny_llama_path, expected):
    runner = _runner(tiny_llama_path, enable_prefix_caching=True)
    runner.generate(PROMPTS[0], GREEDY)
    outs = runner.generate(PROMPTS[1:], GREEDY)
    assert [o.token_ids for o in outs] == expected[1:]
    assert all(o.metrics["num_cached_prompt_tokens"] >= len(SYSTEM) // BS * BS for o in outs)
    assert _all_free(runner)


def test_concurrent_requests_share_blocks(tiny_llama_path):
    runner = _runner(tiny_llama_path, enable_prefix_caching=True)
    runner.generate(SYSTEM + [5], GREEDY)  # warm the cache
    ids = [runner.add_request(p, GREEDY) for p in PROMPTS]
    runner.step()
    tables = [runner.engine.requests[r].block_table for r in ids]
    shared = set.intersection(*(set(t[: len(SYSTEM) // BS]) for t in tables))
    assert len(shared) == len(SYSTEM) // BS
    assert all(runner.engine.memory.pool.blocks[b].ref_count == len(PROMPTS) for b in shared)
    while runner.has_unfinished_requests():
        runner.step()
    assert _all_free(runner)


def test_eviction_under_pressure(tiny_llama_path):
    # 40 blocks: room for a few prompts; a stream of distinct prompts must evict old cached blocks
    runner = _runner(tiny_llama_path, blocks=40, enable_prefix_caching=True)
    reference = _runner(tiny_llama_path, blocks=40)
    prompts = [_tokens(100 + i, 60) for i in range(8)]
    outs = [runner.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert outs == [o.token_ids for o in reference.generate(prompts, GREEDY)]
    again = runner.generate(prompts[0], GREEDY)[0]
    assert again.metrics["num_cached_prompt_tokens"] == 0, "the oldest prompt should have been evicted"
    last = runner.generate(prompts[-1], GREEDY)[0]
    assert last.metrics["num_cached_prompt_tokens"] > 0, "the newest prompt should still be cached"
    assert _all_free(runner)


def test_hash_collision_is_verified(tiny_llama_path, expected, monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, tokens: 42)
    from runner_core.memory import manager
    monkeypatch.setattr(manager, "hash_block", lambda parent, tokens: 42)
    runner = _runner(tiny_llama_path, enable_prefix_caching=True)
    outs = [runner.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    assert outs == expected


def test_defragment_mid_generation_keeps_tokens(tiny_llama_path, expected):
    runner = _runner(tiny_llama_path, blocks=64)
    short = runner.add_request(_tokens(7, 30), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    ids = [runner.add_request(p, GREEDY) for p in PROMPTS]
    done = {}
    for _ in range(4):
        done.update({o.request_id: o for o in runner.step() if o.finished})
    assert short in done  # its low blocks are free now: a hole below live blocks
    report = runner.defragment()
    assert report["blocks_moved"] > 0
    used = runner.memory_stats()["blocks_used"]
    assert sorted(b for r in ids for b in runner.engine.requests[r].block_table) == list(range(used))
    while runner.has_unfinished_requests():
        done.update({o.request_id: o for o in runner.step() if o.finished})
    assert [done[r].token_ids for r in ids] == expected


def test_shrink_releases_memory_and_generation_continues(tiny_llama_path, expected):
    runner = _runner(tiny_llama_path, blocks=128)
    ids = [runner.add_request(p, GREEDY) for p in PROMPTS]
    runner.step()
    before = runner.memory_stats()["kv_pool_bytes"]
    with pytest.raises(InvalidRequestError, match="cannot shrink the KV pool to 3 blocks"):
        runner.defragment(shrink_to_blocks=3)
    report = runner.defragment(shrink_to_blocks=48)
    assert report["blocks_after"] == 48 and report["bytes_released"] == before - runner.memory_stats()["kv_pool_bytes"]
    done = {}
    while runner.has_unfinished_requests():
        done.update({o.request_id: o for o in runner.step() if o.finished})
    assert [done[r].token_ids for r in ids] == expected
    assert runner.memory_stats()["blocks_free"] == 48


def test_a_shrink_without_room_beside_the_old_pool_goes_through_host_memory(tiny_llama_path, expected, monkeypatch):
    """A shrink cloned the kept part while the old pool was alive: old + new at the peak, which a device short of
    memory cannot hold (issue 39). It checks the free memory first; without room the kept part goes through host
    memory, the old pool released (its layers' views unbound) before the new one is made; tokens are unchanged."""
    from runner_core.memory import manager

    runner = _runner(tiny_llama_path, blocks=128)
    ids = [runner.add_request(p, GREEDY) for p in PROMPTS]
    runner.step()
    bound = []
    bind = manager.bind_kv_cache
    monkeypatch.setattr(manager, "bind_kv_cache",
                        lambda model, kv: bound.append(kv[0].numel() and kv.shape[3]) or bind(model, kv))
    asked = []
    monkeypatch.setattr(manager, "available_memory_bytes", lambda device: asked.append(str(device)) or 0)
    runner.defragment(shrink_to_blocks=48)
    # the old pool released (the layers bound to nothing) before the new one is made
    assert asked == ["cpu"] and bound == [0, 48 * runner.engine.memory.block_size]
    done = {}
    while runner.has_unfinished_requests():
        done.update({o.request_id: o for o in runner.step() if o.finished})
    assert [done[r].token_ids for r in ids] == expected


request = st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 10), st.integers(0, 4))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(request, min_size=1, max_size=8), st.sets(st.integers(0, 30), max_size=3), st.integers(0, 999))
def test_sharing_eviction_and_defrag_never_leak_or_double_own(tiny_llama_path, requests, defrag_steps, seed):
    """Requests share one of three prefixes; the pool is small; defragmentation runs at random steps."""
    runner = _shared_runner(tiny_llama_path)
    engine = runner.engine
    prefixes = [_tokens(seed + k, 16) for k in range(3)]
    rnd = random.Random(seed)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][3])
    step = 0
    while pending or runner.has_unfinished_requests():
        while pending and requests[pending[0]][3] <= step:
            k, tail, max_tokens, _ = requests[pending.pop(0)]
            prompt = prefixes[k] + [rnd.randrange(3, 512) for _ in range(tail)]
            runner.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        runner.step()
        if step in defrag_steps:
            runner.defragment()
        holders = Counter(b for s in engine.requests.values() for b in s.block_table)
        pool = engine.memory.pool
        for block in pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.block_id in pool.free_queue) == (block.ref_count == 0)
        assert all(pool.blocks[i].block_id == i for i in range(pool.num_blocks))
        assert all(pool.blocks[i].block_hash == h for h, i in pool.cached.items())
        step += 1
        assert step < 1000
    assert _all_free(runner)


_SHARED: dict = {}


def _shared_runner(path):
    if "r" not in _SHARED:
        _SHARED["r"] = _runner(path, blocks=24, enable_prefix_caching=True, max_model_len=64, max_num_seqs=4)
    return _SHARED["r"]


def test_kv_block_map_shows_owners_and_cached_blocks(tiny_llama_path):
    runner = _runner(tiny_llama_path, enable_prefix_caching=True)
    runner.generate(PROMPTS[0], GREEDY)
    rid = runner.add_request(PROMPTS[1], GREEDY)
    runner.step()
    m = runner.kv_block_map()
    assert m["num_blocks"] == 256 and m["block_size"] == BS
    assert list(m["owners"]) == [rid]
    owned = m["owners"][rid]
    assert owned == runner.engine.requests[rid].block_table
    assert m["cached_block_ids"] and not set(m["cached_block_ids"]) & set(owned)
    while runner.has_unfinished_requests():
        runner.step()
