"""What-if sweeps and the models they plan: config-only models match their published parameter counts and
read like any model directory; SimulatorBackend is a TuneBackend; a what-if sweep over devices measures the
layout that fits and skips the one that does not, with the reason; bands are ordered; the published figures
compare."""

import dataclasses
import math

import pytest

from runner_core.loader.model_loader import read_hf_config
from runner_core.memory.estimate import estimate_memory
from runner_core.memory.shapes import ModelShape
from runner_core.models import MODEL_REGISTRY
from runner_core.models.catalogue import CONFIG_ONLY, catalogue_names, resolve_model
from runner_core.simulator.backend import SimulatorBackend, whatif
from runner_core.simulator.published import PUBLISHED, Comparison, compare_published
from runner_core.simulator.simulation import Simulation
from runner_core.tuning import Arrivals, Lengths, SweepSpace, Target, TuneBackend, Workload

PUBLISHED_PARAMETERS = {"llama-3-70b": 70.6e9, "llama-3.1-8b": 8.0e9, "llama-2-70b": 69.0e9,
                        "mixtral-8x7b": 46.7e9, "qwen3-30b-a3b": 30.5e9}
SMALL = Workload(num_requests=12, arrivals=Arrivals.burst(), prompt_len=Lengths.fixed(64),
                 output_len=Lengths.fixed(16))


@pytest.mark.parametrize("name", catalogue_names(CONFIG_ONLY))
def test_config_model_matches_its_published_shape(name):
    path = resolve_model(name)
    hf_config = read_hf_config(path)
    assert MODEL_REGISTRY.get_adapter(hf_config).impl == "native"
    shape = ModelShape.from_hf_config(hf_config)
    count = sum(math.prod(s) for _, s in shape.checkpoint_tensors())
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.02)
    estimate = estimate_memory(path, dtype="bfloat16", tensor_parallel_size=8, device="cuda")
    assert estimate.weights_bytes == pytest.approx(2 * count / 8, rel=0.05)  # bf16, split 8 ways


def test_the_config_only_models_are_the_published_ones():
    assert set(catalogue_names(CONFIG_ONLY)) == set(PUBLISHED_PARAMETERS)


def test_simulator_backend_is_a_tune_backend_with_simulation_settings():
    with SimulatorBackend({"model": "llama-3-70b", "tensor_parallel_size": 8, "max_num_seqs": 16},
                          Simulation(hardware="h200")) as backend:
        assert isinstance(backend, TuneBackend)
        settings = backend.settings()
        assert (settings["hardware"], settings["band"], settings["tensor_parallel_size"]) == ("h200", "typical", 8)
        assert backend.apply({"max_num_seqs": 8})["rebuilt"] != "reload"  # a live change
        assert backend.apply({"band": "high"})["rebuilt"] == "reload"
        assert backend.settings()["band"] == "high"
        assert backend.run(SMALL, Target()).summary["completed"] == SMALL.num_requests
        with pytest.raises(ValueError, match="unknown what-if settings"):
            backend.apply({"gpus": 8})


def test_whatif_skips_the_layout_that_does_not_fit_and_bands_the_one_that_does():
    layouts = [{"hardware": "h100-sxm", "tensor_parallel_size": 8}, {"hardware": "l4", "tensor_parallel_size": 1}]
    result = whatif("llama-3-70b", SMALL, Target(), layouts, base_config={"max_num_seqs": 16},
                    space=SweepSpace(concurrency=[8]))
    assert [s["settings"] for s in result.skipped] == [layouts[1]]
    assert "memory" in result.skipped[0]["why"].lower()
    measured = {p["values"]["hardware"] for p in result.points}
    assert measured == {"h100-sxm"}
    for point in result.points:
        typical = point["median"]["output_throughput"]
        assert 0 < point["band_low"] <= typical <= point["band_high"]
    assert {"band_low", "band_high"} <= set(result.points_dataframe().columns)


def test_compare_published_returns_every_field_for_a_figure():
    figure = next(f for f in PUBLISHED if f.model == "llama-2-70b" and f.max_num_seqs == 64)
    (row,) = compare_published(num_requests=16, figures=[figure])
    assert row["error"] is None
    assert row["published"] == figure.value and row["source"].startswith("https://")
    assert 0 < row["predicted_low"] <= row["predicted_typical"] <= row["predicted_high"]
    assert isinstance(row["inside"], bool) and row["ratio"] > 0


BAND = {"low": 3000.0, "typical": 3400.0, "high": 3600.0}


@pytest.mark.parametrize("published, inside, ratio", [
    (2999.0, False, 1.1337), (3000.0, True, 1.1333), (3317.0, True, 1.0250), (3600.0, True, 0.9444),
    (3601.0, False, 0.9442)])
def test_a_published_value_is_inside_a_band_that_holds_it_ends_included(published, inside, ratio):
    figure = dataclasses.replace(next(f for f in PUBLISHED if f.model == "llama-2-70b"), value=published)
    row = Comparison(figure, predicted=dict(BAND)).row()
    assert row["inside"] is inside
    assert row["ratio"] == pytest.approx(ratio, abs=1e-4)  # typical / published
    assert (row["predicted_low"], row["predicted_typical"], row["predicted_high"]) == (3000.0, 3400.0, 3600.0)
    refused = Comparison(figure, error="the layout does not fit").row()
    assert refused["inside"] is None and refused["ratio"] is None and refused["error"] == "the layout does not fit"


def test_every_published_figure_says_where_its_settings_come_from():
    for figure in PUBLISHED:
        assert set(figure.setting_sources) == {"kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens"}
        assert all(figure.setting_sources.values()), figure.name
        config = figure.config()
        assert config.get("max_num_seqs") == figure.max_num_seqs
        assert config.get("max_num_batched_tokens") == figure.max_num_batched_tokens


def test_compare_published_prices_one_runs_steps_at_each_band_end_as_separate_runs_would():
    figure = next(f for f in PUBLISHED if f.model == "llama-2-70b" and f.max_num_seqs == 64)
    (row,) = compare_published(num_requests=16, figures=[figure])
    workload = figure.workload.replace(num_requests=16)
    with SimulatorBackend(figure.config(), figure.simulation()) as backend:
        for band in ("low", "typical", "high"):
            backend.apply({"band": band})
            assert row[f"predicted_{band}"] == pytest.approx(backend.run(workload, Target()).summary[figure.metric])


def test_a_sweep_may_set_the_kv_cache_dtype():
    with SimulatorBackend({"model": "llama-3.1-8b", "max_model_len": 2048, "max_num_seqs": 16},
                          Simulation(hardware="h100-sxm")) as backend:
        blocks = backend.capacity()["kv_tokens"]
        assert backend.settings()["kv_cache_dtype"] is None
        assert backend.apply({"kv_cache_dtype": "fp8"})["rebuilt"] == "reload"
        assert backend.settings()["kv_cache_dtype"] == "fp8"
        assert backend.capacity()["kv_tokens"] == pytest.approx(2 * blocks, rel=1e-3)
