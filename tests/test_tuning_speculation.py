"""speculative_config as a knob of tune(): its values (off, then n-gram at each k, normalised as RunnerConfig keeps
them), its short labels, and a small real sweep on tiny-speaker through RunnerBackend that switches speculation on
and off live (reconfigure, never a reload) and leaves the runner as it was. No timed assertions."""

from __future__ import annotations

import pytest

from runner_core.tuning import Lengths, RunnerBackend, SweepSpace, Target, Workload, speculation_values, tune
from runner_core.tuning.results import settings_label

WORKLOAD = Workload(num_requests=4, prompt_len=Lengths.fixed(24), output_len=Lengths.fixed(12))


def test_speculation_values_and_labels():
    values = speculation_values([2, 4], prompt_lookup_min=1)
    assert values[0] is None and [v["num_speculative_tokens"] for v in values[1:]] == [2, 4]
    assert values[1] == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 1}
    assert settings_label({"concurrency": 2, "speculative_config": values[2]}) == (
        "concurrency=2 speculative_config=ngram/k=4")
    assert settings_label({"speculative_config": None}) == "speculative_config=off"


def test_a_sweep_switches_speculation_live_and_restores_the_runner():
    space = SweepSpace(concurrency=[2], scheduler={"speculative_config": speculation_values([3])})
    with RunnerBackend({"model": "tiny-speaker", "dtype": "float32", "kv_cache_memory": 1 << 22,
                        "max_model_len": 128}) as backend:
        runner = backend.runner
        result = tune(space, WORKLOAD, Target("tpot_p99_ms", 1e6), backend=backend, repeats=1, warmup=0)
        assert backend.runner is runner  # switched by reconfigure: the same runner, weights never read again
        assert backend.runner.config.speculative_config is None  # left as it was
    tried = [p["settings"].get("speculative_config") for p in result.points]
    assert None in tried and any(t and t["num_speculative_tokens"] == 3 for t in tried)
    rows = [r for r in result.rows if r["stage"] == "scheduler"]
    assert rows and all(r["rebuilt"] != "reload" for r in rows)
    assert all(r["output_throughput"] > 0 for r in result.rows)


def test_a_session_sweep_switches_speculation_on_the_loaded_model():
    """The same knob through session.tune (workbench's SessionBackend: session.reconfigure by the sweep)."""
    from tests.sessions import TINY
    from workbench import Session

    s = Session()
    try:
        entry = s.load_model("tiny-speaker", **TINY)
        runner = entry.runner
        space = SweepSpace(concurrency=[2], scheduler={"speculative_config": speculation_values([2])})
        result = s.tune(space, WORKLOAD, target=Target("tpot_p99_ms", 1e6), repeats=1, warmup=0).result(300)
        assert s.models["tiny-speaker"].runner is runner  # reconfigured, never reloaded
        tried = [p["settings"].get("speculative_config") for p in result.points]
        assert None in tried and any(t and t["num_speculative_tokens"] == 2 for t in tried)
        assert s.models["tiny-speaker"].config.speculative_config is None  # the sweep put it back
    finally:
        s.close()


def test_the_tuning_forms_k_values_become_the_speculation_knob():
    from workbench.views.controller import tune_plan

    space, _, _, _ = tune_plan("1, 2", "", "tpot_p99_ms", 100.0, 1, 8, speculation="2, 4")
    assert space.scheduler == {"speculative_config": speculation_values([2, 4])}
    assert tune_plan("1", "", "tpot_p99_ms", 100.0, 1, 8)[0].scheduler == {}  # empty: as loaded
    with pytest.raises(ValueError, match="n-gram speculation k values: 'x'"):
        tune_plan("1", "", "tpot_p99_ms", 100.0, 1, 8, speculation="2, x")
