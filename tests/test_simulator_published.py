"""The simulator's overlap scheduler (runner_core/simulator/cost_model.py, simulation.py): a step's host work
overlapped with the device's under async_scheduling, and a GPU prediction that never reads this CPU's
calibration (the GPUs' fixed costs are their band's constants)."""

import dataclasses
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from runner_core import ModelRunner
from runner_core.memory.shapes import ModelShape
from runner_core.simulator import calibration
from runner_core.simulator.cost_model import CostModel
from runner_core.simulator.hardware import Coefficients, get_hardware
from runner_core.simulator.simulation import Simulation

H100 = get_hardware("h100-sxm")


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
    runner = ModelRunner(config, simulate=Simulation(hardware="h100-sxm", async_scheduling=True)).load_model()
    try:
        assert runner.engine.cost_model.host_overlap is True
    finally:
        runner.shutdown()


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
    runner = ModelRunner({"model": "llama-3.1-8b", "max_model_len": 2048, "max_num_seqs": 16},
                         simulate="h100-sxm").load_model()
    try:
        assert runner.engine.cost_model.coefficients == H100.coefficients("typical")
    finally:
        runner.shutdown()
    assert reads == []
