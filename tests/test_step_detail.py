"""Each step's detail (runner_core/engine/step_detail.py): which requests ran, were admitted, preempted and
for whom, finished, and who owned each KV block after the step; read back against the step records, the
requests' own figures and the pool, under preemption and prefix caching."""

from __future__ import annotations

import pytest
import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.engine.step_detail import SHARED, StepDetailRecorder

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BYTES_PER_BLOCK = 16 * 4 * 2 * 2 * 32 * 4  # tiny-llama, float32: block 16, 2 layers, K and V, 4 kv heads x 32


def _prompts(n=6, seed=5):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (32,), generator=g).tolist()  # two full blocks every prompt starts with
    return [shared + torch.randint(3, 500, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 60, (n,), generator=g)]


@pytest.fixture(scope="module")
def run(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "max_model_len": 128,
                          "kv_cache_memory": 10 * BYTES_PER_BLOCK, "enable_prefix_caching": True}).load_model()
    runner.record_step_detail()
    outs = runner.generate(_prompts(), GREEDY)
    return runner, outs, list(runner.step_metrics), list(runner.step_details)


def test_each_step_has_one_detail_that_agrees_with_its_record(run):
    runner, outs, records, details = run
    assert [d.step for d in details] == [r.step for r in records]
    for record, detail in zip(records, details, strict=True):
        assert len(detail.scheduled) == record.num_seqs
        assert sum(n for _, n, _ in detail.scheduled) == record.num_prefill_tokens + record.num_decode_tokens
        assert sum(n for _, n, prompt in detail.scheduled if not prompt) == record.num_decode_tokens
        assert len(detail.admitted) == record.num_admitted and len(detail.preempted) == record.num_preempted
        assert len(detail.waiting) == record.num_waiting
        used = sum(1 for i in detail.block_owner if i >= 0 or i == SHARED)
        assert used == record.blocks_used


def test_preemptions_name_the_request_that_needed_the_blocks_and_every_request_finishes_once(run):
    runner, outs, records, details = run
    preempted = [p for d in details for p in d.preempted]
    assert len(preempted) == sum(o.metrics["num_preemptions"] for o in outs) > 0
    for detail in details:
        ran = {rid for rid, _, _ in detail.scheduled}
        for victim, needed_by in detail.preempted:
            assert victim != needed_by or victim not in ran  # a request preempted for itself did not run
            assert victim in detail.waiting
    finished = [rid for d in details for rid in d.finished]
    assert sorted(finished) == sorted(o.request_id for o in outs)


def holders(detail, block: int) -> list[str]:
    i = detail.block_owner[block]
    return [detail.owners[j] for j in (detail.shared[block] if i == SHARED else [i])]


def test_the_block_maps_replay_the_pool_step_by_step(run):
    """A block a step allocates goes to a request that ran in it; a block it frees was held by a request that
    finished or was preempted in it; the shared prefix shows as shared while two requests hold it; the last map
    is the pool's own, with the shared prefix still cached."""
    runner, outs, records, details = run
    for before, after in zip([None, *details], details, strict=False):
        allocated, freed = after.blocks_changed(before)
        ran = {rid for rid, _, _ in after.scheduled}
        left = set(after.finished) | {victim for victim, _ in after.preempted}
        assert {rid for b in allocated for rid in holders(after, b)} <= ran
        assert {rid for b in freed for rid in holders(before, b)} <= left
    assert any(d.blocks_changed(p)[1] for p, d in zip(details, details[1:], strict=False))
    assert any(d.shared for d in details)
    last = details[-1].block_map()
    assert last["owners"] == {}
    now = runner.engine.kv_block_map()  # the pool's own map: the same blocks (it orders them by table and queue)
    assert now["owners"] == {} and sorted(now["cached_block_ids"]) == last["cached_block_ids"]
    assert last["cached_block_ids"], "the shared prefix stays cached after the run"


def test_it_is_off_until_asked_and_its_bound_follows_the_pool(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    runner.generate([[5, 6, 7]], GREEDY)
    assert list(runner.step_details) == []
    assert StepDetailRecorder(num_blocks=1000, budget_bytes=2_000_000).max_steps == 1000
    assert StepDetailRecorder(num_blocks=10, budget_bytes=1 << 30).max_steps == 2048
