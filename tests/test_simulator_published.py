"""Published GPU figures and what the comparison rests on (runner_core/simulator/published.py, held_out.py,
trtllm_limits.py, the overlap scheduler of cost_model.py): trtllm-bench's batch-limit rule as its source states
it, the 1.0 figures' limits derived by that rule, a step's host work overlapped with the device's, the no-evict
batch, a GPU prediction that never reads this CPU's calibration, the held-out figures kept apart from the ones
the simulator was developed against, and the docs' held-out error equal to what the code computes."""

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from runner_core.memory.shapes import ModelShape
from runner_core.simulator import calibration
from runner_core.simulator.cost_model import CostModel
from runner_core.simulator.hardware import Coefficients, get_hardware
from runner_core.simulator.held_out import HELD_OUT, held_out_error
from runner_core.simulator.published import PUBLISHED, SimulatorBackend, compare_published, no_evict_batch
from runner_core.simulator.runner import SimulatedRunner
from runner_core.simulator.simulation import Simulation
from runner_core.simulator.trtllm_limits import _round_batch, _round_tokens, trtllm_bench_limits

DOCS = Path(__file__).resolve().parents[1] / "docs" / "whatif.md"
H100 = get_hardware("h100-sxm")


# ---- trtllm-bench's rule ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, batch", [(1, 64), (64.5, 96), (255.9, 256), (256, 256), (256.1, 384), (1023, 1024),
                                        (1024, 1024), (1024.5, 1280)])
def test_trtllm_bench_rounds_the_batch_up_in_its_documented_steps(raw, batch):
    assert _round_batch(raw) == batch


@pytest.mark.parametrize("raw, tokens", [(10, 2048), (2049, 2304), (4095, 4096), (4096, 4096), (4097, 4608),
                                         (8191, 8192), (8192, 8192), (8193, 9216)])
def test_trtllm_bench_rounds_the_token_budget_up_in_its_documented_steps(raw, tokens):
    assert _round_tokens(raw) == tokens


@pytest.mark.parametrize("model, hardware, tp, isl, osl, batch, tokens", [
    ("llama-3-70b", "h100-sxm", 2, 1000, 1000, 384, 2048),  # 276 requests of 2000 tokens in 84.2 GiB of KV
    ("llama-3-70b", "h200", 1, 1000, 1000, 224, 2048),  # 220.3 requests: below 256, a multiple of 32
    ("llama-3.1-8b", "h100-sxm", 1, 1000, 1000, 640, 2048),
    ("llama-3.1-8b", "h100-sxm", 1, 2048, 128, 512, 9216),  # 489 x (1 + 2048/128) = 8313 tokens -> 9 x 1024
])
def test_trtllm_bench_limits_reproduce_the_rule_on_the_published_settings(model, hardware, tp, isl, osl, batch,
                                                                          tokens):
    limits = trtllm_bench_limits(model, hardware, tensor_parallel_size=tp, input_len=isl, output_len=osl)
    assert (limits.max_batch_size, limits.max_num_tokens) == (batch, tokens)


def test_chunked_prefill_off_raises_the_token_budget_to_a_whole_prompt_and_a_batch():
    off = trtllm_bench_limits("llama-3.1-8b", "h100-sxm", input_len=20000, output_len=2000)
    on = trtllm_bench_limits("llama-3.1-8b", "h100-sxm", input_len=20000, output_len=2000, chunked_prefill=True)
    assert off.max_num_tokens == 20000 + off.max_batch_size > on.max_num_tokens
    with pytest.raises(ValueError, match="needs .* GiB of weights"):
        trtllm_bench_limits("llama-3-70b", "l4", input_len=128, output_len=128)


def test_every_trtllm_1_0_figure_takes_its_batch_limits_from_the_rule():
    figures = [f for f in PUBLISHED if f.engine == "TensorRT-LLM 1.0"]
    assert len(figures) == 6
    for f in figures:
        limits = trtllm_bench_limits(f.model, f.hardware, tensor_parallel_size=f.tensor_parallel_size,
                                     input_len=f.workload.prompt_len.high, output_len=f.workload.output_len.high)
        assert (f.max_num_seqs, f.max_num_batched_tokens) == (limits.max_batch_size, limits.max_num_tokens)
        assert "trtllm_bench_limits" in f.setting_sources["max_num_seqs"]
        assert f.async_scheduling and f.no_evict and set(f.engine_sources) == {"async_scheduling", "no_evict"}


# ---- the overlap scheduler -------------------------------------------------------------------------------------
def _llama_8b() -> ModelShape:
    return ModelShape.from_hf_config(LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192))


def test_an_overlapped_step_takes_the_larger_of_host_and_device_work():
    c = H100.coefficients("typical")
    serial = CostModel(_llama_8b(), H100, c, dtype="bfloat16")
    overlap = CostModel(_llama_8b(), H100, c, dtype="bfloat16", host_overlap=True)
    for starts, new, sampled in (([1500] * 640, [1] * 640, 640), ([0], [16], 1)):
        parts = serial.breakdown(starts, new, sampled)
        host = c.step_s + len(starts) * c.seq_s
        device = parts["total_s"] - host
        assert parts["host_s"] == pytest.approx(host) and parts["hidden_s"] == 0
        assert overlap.step_time(starts, new, sampled) == pytest.approx(max(device, host))
        hidden = overlap.breakdown(starts, new, sampled)
        assert hidden["hidden_s"] == pytest.approx(min(device, host))
        assert hidden["total_s"] == pytest.approx(overlap.step_time(starts, new, sampled))
    with pytest.raises(ValueError, match="host_overlap=False"):
        overlap.features([100], [1], 1)


def test_async_scheduling_is_a_simulation_setting_the_cost_model_follows():
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        Simulation(hardware="h100-sxm", async_scheduling="yes")
    config = {"model": "llama-3.1-8b", "max_model_len": 2048, "max_num_seqs": 16}
    runner = SimulatedRunner(config, Simulation(hardware="h100-sxm", async_scheduling=True)).load_model()
    try:
        assert runner.engine.cost_model.host_overlap is True
    finally:
        runner.shutdown()


# ---- the batch, and what a GPU prediction reads ----------------------------------------------------------------
def test_a_no_evict_batch_holds_every_admitted_request_whole():
    figure = next(f for f in PUBLISHED if f.name == "trtllm1.0-llama3.1-8b-fp8-h100-tp1-1000-1000")
    with SimulatorBackend(figure.config(), figure.simulation()) as backend:
        batch = no_evict_batch(backend, figure)
        capacity = backend.capacity()
        assert batch < figure.max_num_seqs  # KV for 640 whole 2000-token requests is more than the pool
        assert batch * 2000 <= capacity["kv_tokens"] < (batch + 1) * 2000 + capacity["block_size"]


def test_a_gpu_prediction_never_reads_this_cpus_calibration(monkeypatch):
    """The GPUs' fixed costs (step, layer, sequence) are their band's constants: a CPU calibration with absurd
    fitted host costs changes no GPU step."""
    reads = []
    absurd = Coefficients(0.1, 0.5, 0.1, 0.1, step_s=1.0, layer_s=1.0, seq_s=1.0, token_s=1.0)

    def load():
        reads.append(1)
        return SimpleNamespace(hardware=dataclasses.replace(H100, name="cpu:test", kind="cpu", band={},
                                                            efficiency=absurd))

    monkeypatch.setattr(calibration, "load_calibration", load)
    runner = SimulatedRunner({"model": "llama-3.1-8b", "max_model_len": 2048, "max_num_seqs": 16},
                             "h100-sxm").load_model()
    try:
        assert runner.engine.cost_model.coefficients == H100.coefficients("typical")
    finally:
        runner.shutdown()
    assert reads == []


# ---- held out --------------------------------------------------------------------------------------------------
def test_held_out_figures_come_from_other_sources_than_the_development_ones():
    developed = {f.source for f in PUBLISHED}
    assert HELD_OUT and not {f.name for f in HELD_OUT} & {f.name for f in PUBLISHED}
    for f in HELD_OUT:
        assert f.source not in developed and "TensorRT-LLM" not in f.source and f.source.startswith("https://")
        assert set(f.setting_sources) == {"kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens"}


def _docs_section(marker: str) -> str:
    text = DOCS.read_text()
    start = text.index(marker)
    return text[start:text.index("\n\n", text.index("|", start))]


def test_the_docs_state_the_held_out_error_the_code_computes():
    rows = compare_published(figures=HELD_OUT)
    error = held_out_error(rows)
    table = _docs_section("<!-- figures: held_out_error() -->")
    for row in rows:
        line = next(x for x in table.splitlines() if row["figure"] in x)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-3:] == [f"{row['predicted_low']:.0f} / {row['predicted_typical']:.0f} / "
                              f"{row['predicted_high']:.0f}", "yes" if row["inside"] else "no", f"{row['ratio']:.2f}"]
    text = DOCS.read_text()
    stated = re.search(r"Held-out error: (\d+) of (\d+) inside the band, typical off by (\d+)% median "
                       r"\(at most (\d+)%\)", text)
    assert stated, "docs/whatif.md states no held-out error"
    assert [int(g) for g in stated.groups()] == [error["inside"], error["figures"], round(100 * error["median_error"]),
                                                 round(100 * error["max_error"])]
    readme = " ".join((DOCS.parents[1] / "README.md").read_text().split())
    developed, held, median = re.search(r"the (\d+) TensorRT-LLM figures it was developed against fall inside their "
                                        r"band .*? on (\d+) held-out NIM figures the typical prediction is (\d+)% low "
                                        r"\(median\)", readme).groups()
    assert (int(developed), int(held)) == (len(PUBLISHED), len(HELD_OUT))
    assert int(median) == round(100 * error["median_error"])
