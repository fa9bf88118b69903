"""The what-if pricing of speculative decoding (runner_core.simulator.speculation): the expected tokens a verified
step gives, a verification step of k+1 tokens a sequence priced by the cost model against a decode step, and a sweep
over k, acceptance and batch on a GPU that is not here (no weights: the config-only qwen2.5-0.5b on an H100)."""

from __future__ import annotations

import pytest

from runner_core import ConfigError
from runner_core.simulator import SimulatedRunner, expected_tokens_per_step, price_speculation, speculation_sweep

QWEN = {"model": "qwen2.5-0.5b", "dtype": "bfloat16", "max_model_len": 4096}


def test_expected_tokens_per_step_is_the_truncated_geometric_sum():
    assert expected_tokens_per_step(0.0, 4) == 1.0  # nothing accepted: the replacement token only
    assert expected_tokens_per_step(1.0, 4) == 5.0  # all accepted, and the bonus token
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(0.8, 3) == pytest.approx((1 - 0.8 ** 4) / (1 - 0.8))
    with pytest.raises(ValueError, match="acceptance_rate"):
        expected_tokens_per_step(1.5, 2)


def test_a_sweep_prices_verification_and_speculation_stops_paying_as_the_batch_grows():
    rows = speculation_sweep(QWEN, "h100-sxm", ks=(0, 2, 4), acceptance_rates=(0.0, 0.8),
                             batch_sizes=(1, 512), context=256)
    assert len(rows) == 3 * 2 * 2 and {r["hardware"] for r in rows} == {"h100-sxm"}
    by = {(r["k"], r["acceptance_rate"], r["batch"]): r for r in rows}
    for b in (1, 512):
        assert by[0, 0.8, b]["speedup"] == pytest.approx(1.0)  # k=0: the decode step itself
        assert by[4, 0.8, b]["verify_step_s"] > by[4, 0.8, b]["decode_step_s"]  # k+1 tokens cost more
        assert by[4, 0.0, b]["speedup"] < 1.0  # nothing accepted: verification is pure cost
        r = by[4, 0.8, b]
        assert r["spec_tokens_per_s"] == pytest.approx(b * r["tokens_per_step"] / r["verify_step_s"])
    # batch 1 reads the weights for one token: the drafts ride along nearly free; a large batch pays for them
    assert by[4, 0.8, 1]["speedup"] > 2.0
    assert by[4, 0.8, 512]["speedup"] < by[4, 0.8, 1]["speedup"]


def test_price_speculation_takes_a_cost_model_and_the_simulated_runner_points_to_it():
    runner = SimulatedRunner(QWEN, "h100-sxm").load_model()
    try:
        row = price_speculation(runner.engine.cost_model, 1, 128, 3, 0.6)
        assert row["tokens_per_step"] == pytest.approx(expected_tokens_per_step(0.6, 3))
    finally:
        runner.shutdown()
    with pytest.raises(ConfigError, match="speculation_sweep"):
        SimulatedRunner({**QWEN, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                        "h100-sxm").load_model()
