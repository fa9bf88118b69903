"""This CPU's calibration: its measured spec, a fit on the real engine's steps (tiny-llama, a few shapes), the
saved JSON read back, a simulation on the calibrated spec, the step validation's fields. The errors depend on how
busy the machine is (make bench-whatif reports them): the one bound here, on the fit's error over its own rows, is
loose enough for a busy machine and still catches a fit that went the wrong way."""

from __future__ import annotations

import json

import pytest

from runner_core.simulator.calibrate import Calibration, ShapeSweep, calibrate, cpu_tier, load_calibration
from runner_core.simulator.runner import SimulatedRunner
from runner_core.simulator.simulation import Simulation
from runner_core.simulator.validate import step_kind, validate_steps
from runner_core.tuning import Lengths, Workload, run_workload

# a few shapes of every kind: pure prefills (one chunked past the 512-token budget), decodes of 8 and 2 rows at
# two KV lengths, a prompt added while they decode
TINY_SHAPES = ShapeSweep(contexts=(16, 200), decodes=(8, 2), prefills=(64, 600), chunks=(48,), decode_steps=2)
# The fit's median relative error over the rows it was fitted to: 1.0-1.6% on these shapes (AMD EPYC, 2 cores,
# load average 1.6 from other work, 2026-12-05); with the least-squares step's sign flipped it was 62-90%.
FIT_MEDIAN_ERROR_BOUND = 0.3


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("whatif") / "calibration.json"
    return calibrate("tiny-llama", dtype="float32", shapes=TINY_SHAPES, repeats=2, models=[], path=path), path


def test_the_calibrated_cpu_is_measured_peaks_bandwidth_and_its_tier(calibrated):
    spec = calibrated[0].hardware  # measure_cpu() on the calibration's threads
    assert spec.kind == "cpu" and spec.name.startswith("cpu:") and f"({cpu_tier()})" in spec.name
    assert spec.peak_flops["float32"] > 0 and spec.peak_flops["bfloat16"] > 0
    assert spec.mem_bandwidth > 0 and spec.memory_bytes > 0
    assert spec.link_latency_s == 0 and spec.devices_per_node == 1


def test_calibration_fits_non_negative_coefficients_on_rows_that_carry_their_shapes(calibrated):
    cal, _ = calibrated
    c = cal.coefficients
    assert min(c.compute_efficiency, c.memory_efficiency, c.attention_efficiency, c.decode_attention_efficiency) > 0
    assert min(c.step_s, c.layer_s, c.seq_s, c.token_s) >= 0
    assert cal.dtype == "float32" and cal.models == ["tiny-llama"] and cal.settings["cpu_threads"] >= 1
    assert {step_kind(r) for r in cal.rows} == {"decode", "prefill", "mixed"}
    for r in cal.rows:
        assert len(r["starts"]) == len(r["num_new_tokens"]) >= 1 and r["seconds"] > 0 and r["runs"] >= 1
    shapes = {(tuple(r["starts"]), tuple(r["num_new_tokens"])) for r in cal.rows}
    assert ((0,), (64,)) in shapes and ((0,), (512,)) in shapes and ((512,), (88,)) in shapes  # 600: chunked
    assert any(r["num_new_tokens"] == [1] * 8 and min(r["starts"]) >= 200 for r in cal.rows)  # 8 rows at KV 200+
    assert set(cal.fit_error) >= {"median_error", "p90_error", "n"} and cal.fit_error["n"] == len(cal.rows)
    assert cal.fit_error["median_error"] < FIT_MEDIAN_ERROR_BOUND, cal.fit_error


def test_calibration_json_round_trips(calibrated):
    cal, path = calibrated
    again = load_calibration(path)
    assert isinstance(again, Calibration) and again.to_dict() == cal.to_dict()
    assert again.hardware.efficiency == cal.coefficients


def test_a_calibration_saved_with_one_attention_efficiency_predicts_as_before(calibrated, tmp_path):
    cal, path = calibrated
    old = json.loads(path.read_text())
    del old["hardware"]["efficiency"]["decode_attention_efficiency"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    c = load_calibration(tmp_path / "old.json").coefficients
    assert c.decode_attention_efficiency == c.attention_efficiency == cal.coefficients.attention_efficiency


def test_load_calibration_is_none_without_a_file_and_names_a_broken_one(tmp_path):
    assert load_calibration(tmp_path / "none.json") is None
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="broken.json.*make bench-whatif"):
        load_calibration(broken)


def test_a_simulation_on_the_calibrated_spec_runs_a_workload(calibrated):
    cal, _ = calibrated
    runner = SimulatedRunner({"model": "tiny-llama", "dtype": cal.dtype, **cal.settings},
                             Simulation(hardware=cal.hardware)).load_model()
    try:
        result = run_workload(runner, Workload(num_requests=6, prompt_len=Lengths.uniform(8, 40),
                                               output_len=Lengths.uniform(4, 12)))
    finally:
        runner.shutdown()
    assert result.summary["completed"] == 6 and result.summary["duration_s"] > 0
    assert result.summary["output_throughput"] > 0


def test_validate_steps_scores_the_given_rows(calibrated):
    cal, _ = calibrated
    rows = cal.rows[:5]
    out = validate_steps(cal, rows)
    assert out["n"] == 5 and 0 <= out["median_error"] <= out["p90_error"]
    assert sum(k["n"] for k in out["by_kind"].values()) == 5
    with pytest.raises(ValueError, match="no rows"):
        validate_steps(cal, [])
