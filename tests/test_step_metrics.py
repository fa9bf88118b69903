"""The step's metrics record: its phase times add up to the step's total, and the total counts the
observer's own time (making the record), so the share outside the forward includes recording; the KV
waste figures are computed only when asked for (every step, or on demand), and on demand they equal
what recording them every step gives."""

from __future__ import annotations

import time

import pytest

from runner_core import ModelRunner, SamplingParams
from runner_core.engine import step_metrics

DELAY = 0.02  # seconds the observer is slowed by, per step


def test_total_counts_the_observers_own_time(tiny_llama_path, monkeypatch):
    """A slow observer shows in observe_s and in total_s: every record's phases add up to its total,
    and the part beyond schedule + prepare + forward + sample is at least the delay added."""
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    waste = step_metrics.static_reservation_waste

    def slow_waste(*args):
        time.sleep(DELAY)  # sleeps at least DELAY: a lower bound, not a timing guess
        return waste(*args)

    monkeypatch.setattr(step_metrics, "static_reservation_waste", slow_waste)
    runner.record_waste_per_step()  # the slowed figure is one of them
    runner.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    steps = list(runner.step_metrics)
    assert len(steps) == 3
    for m in steps:
        work = m.schedule_s + m.prepare_s + m.forward_s + m.sample_s
        assert m.total_s - work >= DELAY
        assert m.total_s == pytest.approx(work + m.observe_s, abs=1e-9) and m.observe_s >= DELAY


def test_on_cuda_the_forward_is_timed_to_its_end_on_the_device(tiny_llama_path, monkeypatch):
    """CUDA runs a forward asynchronously: the engine's clock read after its launch put the GPU's time into
    sample_s (issue 39). The worker waits for the device after the forward, before the engine stamps it
    executed. Checked on the CPU with the worker's device taken for CUDA and the sync recorded."""
    import torch

    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    engine, events = runner.engine, []
    worker, clock = engine.worker, engine.clock
    execute = worker.forward_pass.execute
    monkeypatch.setattr(worker.forward_pass, "execute", lambda inp: events.append("forward") or execute(inp))
    monkeypatch.setattr(worker, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    monkeypatch.setattr(engine, "clock", type("Clock", (), {"now": lambda _: events.append("clock") or clock.now(),
                                                             "sleep_until": clock.sleep_until})())
    runner.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    step = events[events.index("forward"):]
    assert step[:3] == ["forward", ("sync", "cuda"), "clock"]  # forward, wait for the GPU, then the executed stamp


BYTES_PER_BLOCK = 16 * 4 * 2 * 2 * 32 * 4  # tiny-llama: 16 tokens x 4 layers x K,V x 2 KV heads x 32 dims x fp32
WASTE = ("kv_utilization", "internal_fragmentation", "static_reservation_waste", "firstfit_reserved_waste",
         "firstfit_external_fragmentation")


def test_waste_figures_only_when_asked_and_the_same_on_demand(tiny_llama_path, monkeypatch):
    """Two runners step the same requests in lockstep on a pool too small for all of them (first fit
    defers some): one records the waste figures every step, the other never computes them on the step's
    path (its records carry None), yet its memory_stats(), asked mid-run and at the end, equal the
    first's: the first-fit simulation takes the admissions and releases it missed, in order."""
    config = {"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 8 * BYTES_PER_BLOCK,
              "max_model_len": 128}
    every_step, on_demand = (ModelRunner(dict(config)).load_model() for _ in range(2))
    every_step.record_waste_per_step()
    calls = []
    waste = step_metrics.static_reservation_waste
    monkeypatch.setattr(step_metrics, "static_reservation_waste", lambda *a: calls.append(a) or waste(*a))
    for runner in (every_step, on_demand):
        for k in (40, 35, 30, 25):
            runner.add_request(list(range(3, 3 + k)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    steps = 0
    while every_step.has_unfinished_requests():
        every_step.step()
        before = len(calls)
        on_demand.step()
        assert len(calls) == before  # nothing of it on the on-demand runner's step
        steps += 1
        if steps == 12:
            assert on_demand.memory_stats() == every_step.memory_stats()
    assert not on_demand.has_unfinished_requests()
    assert on_demand.memory_stats() == every_step.memory_stats()
    assert every_step.memory_stats()["firstfit_failed"] > 0  # the comparison had something to defer
    for lazy, eager in zip(on_demand.step_metrics, every_step.step_metrics):
        assert all(getattr(lazy, f) is None for f in WASTE)
        assert all(isinstance(getattr(eager, f), float) for f in WASTE)
        assert (lazy.blocks_used, lazy.blocks_free, lazy.num_running) == (eager.blocks_used, eager.blocks_free,
                                                                         eager.num_running)
