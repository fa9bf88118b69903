"""The step's metrics record: its phase times add up to the step's total, and the total counts the
observer's own time (making the record), so the share outside the forward includes recording."""

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
    runner.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    steps = list(runner.step_metrics)
    assert len(steps) == 3
    for m in steps:
        work = m.schedule_s + m.prepare_s + m.forward_s + m.sample_s
        assert m.total_s - work >= DELAY
        assert m.total_s == pytest.approx(work + m.observe_s, abs=1e-9) and m.observe_s >= DELAY
