"""The simulated runner (runner_core/simulator/runner.py, engine.py): the real scheduler and KV pool on a virtual clock.
A simulated runner schedules exactly as a real one does on the same requests (admissions, chunks, preemptions,
prefix hits, step by step); its clock is the sum of the cost model's step times; load runs take their times
from it; named GPUs plan their pool from their memory and refuse a model that does not fit."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from runner_core.errors import ConfigError, InvalidRequestError
from runner_core.memory import kv_bytes_per_token
from runner_core.model_runner import ModelRunner
from runner_core.sampling_params import SamplingParams
from runner_core.simulator.engine import SimulatedEngine
from runner_core.simulator.hardware import HARDWARE, Coefficients, HardwareSpec
from runner_core.simulator.run import simulate_workload
from runner_core.simulator.runner import SimulatedRunner
from runner_core.simulator.simulation import Simulation
from runner_core.tuning.driver import run_workload
from runner_core.tuning.workload import Arrivals, Lengths, Workload

# a CPU as a calibration would describe it (explicit coefficients: no saved calibration needed)
TEST_CPU = HardwareSpec(name="cpu:test (avx2)", kind="cpu", memory_bytes=16 << 30,
                        peak_flops={"float32": 2e11, "bfloat16": 2e11}, mem_bandwidth=2e10, link_bandwidth=1e10,
                        link_latency_s=1e-5, devices_per_node=1, reserved_bytes=0,
                        efficiency=Coefficients(compute_efficiency=0.5, memory_efficiency=0.6,
                                                attention_efficiency=0.4, decode_attention_efficiency=0.4,
                                                step_s=1e-3, layer_s=2e-5, seq_s=1e-5))
BLOCKS = 16  # tiny-llama's pool in the identity test: 256 tokens, less than four running requests reach
IDENTITY = {"model": "tiny-llama", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 4,
            "max_num_batched_tokens": 32, "enable_prefix_caching": True,
            "kv_cache_memory": BLOCKS * 16 * kv_bytes_per_token(4, 2, 32, "float32")}


def _record_schedule(engine) -> list:
    """Wrap the engine's scheduler.schedule: per step, the scheduled (request id, tokens), the admitted ids
    with the prompt tokens their prefix-cache match gave them, and the preempted ids."""
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append(([(s.request_id, n) for s, n in out.scheduled],
                      [(s.request_id, s.num_cached_tokens) for s in out.admitted],
                      [s.request_id for s in out.preempted]))
        return out

    engine.scheduler.schedule = recorded
    return steps


def _drive(runner) -> list:
    """Eight requests sharing a 40-token prefix, added at fixed step numbers; every one runs to max_tokens."""
    steps = _record_schedule(runner.engine)
    prefix = [(7 * i) % 90 + 3 for i in range(40)]
    due = {0: [0, 1, 2], 3: [3, 4], 9: [5], 14: [6, 7]}
    added, finished, step = 0, set(), 0
    while added < 8 or runner.has_unfinished_requests():
        for i in due.get(step, []):
            prompt = prefix + [(11 * i + j) % 90 + 3 for j in range(8 + 5 * i)]
            runner.add_request(prompt, SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True),
                               request_id=f"r{i}")
            added += 1
        finished |= {o.request_id for o in runner.step() if o.finished}
        step += 1
    assert finished == {f"r{i}" for i in range(8)}
    return steps


def test_scheduling_is_identical_to_a_real_run_step_by_step():
    with ModelRunner(IDENTITY).load_model() as real, SimulatedRunner(IDENTITY, TEST_CPU).load_model() as sim:
        assert isinstance(sim.engine, SimulatedEngine)
        assert sim.memory_stats()["blocks_total"] == real.memory_stats()["blocks_total"] == BLOCKS
        real_steps, sim_steps = _drive(real), _drive(sim)
    assert sim_steps == real_steps
    assert any(preempted for _, _, preempted in real_steps), "the pool was meant to force preemptions"
    assert any(cached for _, admitted, _ in real_steps for _, cached in admitted), "no prefix hit happened"
    assert any(n > 1 and n < 32 for scheduled, _, _ in real_steps for _, n in scheduled)  # chunked prompts


def _tiny(**fields):
    return SimulatedRunner({"model": "tiny-llama", "dtype": "float32", "kv_cache_memory": 1 << 21, "max_model_len": 256,
                            **fields}, TEST_CPU).load_model()


def test_the_virtual_clock_is_the_sum_of_the_predicted_step_times():
    with _tiny(max_num_seqs=8, max_num_batched_tokens=64) as runner:
        outs = runner.generate([[5 + i] * (30 + 20 * i) for i in range(5)], max_new_tokens=12, ignore_eos=True)
        engine = runner.engine
        records = list(runner.step_metrics)
        times = [engine.cost_model.step_time(*r.batch_shape, r.num_sampled) for r in records]
    assert all(len(o.token_ids) == 12 and o.text is not None for o in outs)
    assert engine.clock.now() == pytest.approx(sum(times), rel=1e-9)
    assert [r.total_s for r in records] == pytest.approx(times, rel=1e-9)
    assert [r.forward_s for r in records] == pytest.approx(times, rel=1e-9)


def test_a_load_run_takes_its_times_from_the_step_times():
    workload = Workload(num_requests=6, arrivals=Arrivals.burst(), prompt_len=Lengths.fixed(40),
                        output_len=Lengths.fixed(10))
    with _tiny(max_num_seqs=4, max_num_batched_tokens=64) as runner:
        result = run_workload(runner, workload)
        records = list(runner.step_metrics)
        ends, t = [], 0.0
        for r in records:
            t += runner.engine.cost_model.step_time(*r.batch_shape, r.num_sampled)
            ends.append(t)
    assert [r.time for r in records] == pytest.approx(ends, rel=1e-9)
    assert result.summary["completed"] == 6 and result.summary["duration_s"] == pytest.approx(ends[-1])
    for rec in result.records:  # every token reaches the client at the end of a step
        assert rec.num_output_tokens == 10
        assert all(any(abs(x - e) < 1e-12 for e in ends) for x in rec.token_times)
    first = result.records[0]  # admitted at once: its first token ends the steps its 40-token prompt took
    assert first.ttft == pytest.approx(ends[0])


def test_idle_gaps_of_a_poisson_workload_jump_the_clock(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail(f"a simulation slept {s} s"))
    workload = Workload(num_requests=5, arrivals=Arrivals.poisson(rate=0.5), prompt_len=Lengths.fixed(16),
                        output_len=Lengths.fixed(4), seed=3)
    due = [r.arrival_s for r in workload.requests(1000)]
    with _tiny() as runner:
        result = run_workload(runner, workload)
        busy = sum(r.total_s for r in runner.step_metrics)
    assert result.summary["completed"] == 5
    assert [rec.arrival_time for rec in result.records] == pytest.approx(due)  # each one sent exactly when due
    assert result.summary["duration_s"] > due[-1] > busy  # most of the run was idle time, jumped over


def test_a_70b_model_on_eight_h200_plans_its_pool_from_their_memory_and_generates():
    runner = SimulatedRunner({"model": "llama-3-70b", "tensor_parallel_size": 8}, "h200").load_model()
    with runner:
        info, mem = runner.model_info(), runner.memory_stats()
        outs = runner.generate([[100 + i] * 300 for i in range(3)], max_new_tokens=8)
        elapsed = runner.engine.clock.now()
    h200 = HARDWARE["h200"]
    assert info["device"] == "simulated h200 x8" and info["dtype"] == "bfloat16"
    assert info["simulation"]["devices"] == 8 and info["simulation"]["band"] == "typical"
    assert 70e9 < info["num_parameters"] < 71e9
    assert mem["device_memory_bytes"] == h200.memory_bytes
    assert mem["kv_bytes_per_token"] == 80 * 2 * 1 * 128 * 2  # 8 KV heads over 8 devices: one each
    used = mem["weights_bytes"] + mem["kv_pool_bytes"] + mem["activation_peak_bytes"] + h200.reserved_bytes
    assert 0.8 * h200.memory_bytes < used <= 0.9 * h200.memory_bytes
    assert all(len(o.token_ids) == 8 and o.text == "" for o in outs)  # drawn tokens, never EOS (128001)
    assert elapsed > 0


def test_a_70b_model_on_one_l4_is_refused_naming_memory_and_a_layout_that_fits():
    with pytest.raises(ConfigError, match=r"llama-3-70b does not fit.*GiB.*tensor_parallel_size=\d+"):
        SimulatedRunner({"model": "llama-3-70b"}, "l4").load_model()
    with pytest.raises(ConfigError, match="tensor_parallel_size"):  # a split the heads do not allow
        SimulatedRunner({"model": "llama-3-70b", "tensor_parallel_size": 3}, "h200").load_model()


def test_a_mixture_of_experts_config_runs():
    with SimulatedRunner({"model": "mixtral-8x7b", "tensor_parallel_size": 2},
                         Simulation("h100-sxm", band="low")).load_model() as runner:
        outs = runner.generate([[9] * 200, [8] * 50], max_new_tokens=6)
        assert runner.model_info()["architecture"] == "MixtralForCausalLM"
        assert runner.engine.cost_model.step_time([0], [200], 1) > runner.engine.cost_model.step_time([200], [1], 1)
    assert [len(o.token_ids) for o in outs] == [6, 6]


def test_what_a_simulation_cannot_honour_is_refused():
    with SimulatedRunner({"model": "llama-3.1-8b", "max_model_len": 4096}, "h100-sxm").load_model() as runner:
        with pytest.raises(InvalidRequestError, match="stop strings"):
            runner.add_request([5, 6], SamplingParams(stop=["."]))
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            runner.add_request("hello")
        with pytest.raises(InvalidRequestError, match="computes no logits"):
            runner.forward([[5, 6, 7]])
        with pytest.raises(ConfigError, match="no weights to save"):
            runner.save_pretrained("unused")
        (out,) = runner.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=2))
        padded = runner.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)["sequences"]
    assert out.logprobs is None and len(out.token_ids) == 3
    assert padded.shape == (1, 5)


def test_a_weight_format_changes_what_fits_and_what_the_cost_model_reads():
    config = {"model": "llama-3-70b", "tensor_parallel_size": 4, "max_model_len": 4096, "max_num_batched_tokens": 512}
    with pytest.raises(ConfigError, match="does not fit"):
        SimulatedRunner(config, "l4").load_model()
    with SimulatedRunner(config, Simulation("l4", weight_format="fp8")).load_model() as runner:
        assert runner.model_info()["simulation"]["weight_format"] == "fp8"
        assert runner.engine.cost_model.weight_format == "fp8"
        assert runner.memory_stats()["weights_bytes"] < 18 << 30  # about one byte a weight, over four devices


def test_reconfigure_replans_the_pool_and_compile_is_recorded():
    with _tiny() as runner:
        before = runner.memory_stats()["blocks_total"]
        result = runner.reconfigure(kv_cache_memory=1 << 22, max_num_seqs=8)
        assert result["rebuilt"] == "pool" and runner.memory_stats()["blocks_total"] == 2 * before
        stats = runner.set_compile_mode(True, mode="default")
        assert stats["enabled"] and stats["mode"] == "default"
        assert len(runner.generate([[4] * 20], max_new_tokens=3)[0].token_ids) == 3


def test_simulate_workload_runs_a_workload_and_gives_its_result():
    workload = Workload(num_requests=4, prompt_len=Lengths.fixed(64), output_len=Lengths.fixed(8))
    result = simulate_workload("llama-3.1-8b", workload, simulate="a100-sxm-80g", max_model_len=2048)
    assert result.summary["completed"] == 4 and result.summary["output_tokens"] == 32
    assert result.settings["max_model_len"] == 2048


def test_this_cpu_is_simulated_from_its_saved_calibration(monkeypatch):
    from runner_core.simulator import calibration

    monkeypatch.setattr(calibration, "load_calibration", lambda: None)
    with pytest.raises(ValueError, match=r"make bench-whatif.*calibrate\(\)"):
        SimulatedRunner({"model": "tiny-llama"}, "cpu").load_model()
    monkeypatch.setattr(calibration, "load_calibration", lambda: SimpleNamespace(hardware=TEST_CPU))
    with SimulatedRunner({"model": "tiny-llama", "max_model_len": 256}, "cpu").load_model() as runner:
        assert runner.model_info()["simulation"]["hardware"] == TEST_CPU.name
        assert runner.engine.cost_model.coefficients == TEST_CPU.efficiency
        assert runner.generate("a prompt", max_new_tokens=2)[0].finish_reason == "length"  # the preset's tokenizer


def test_an_fp8_kv_cache_doubles_the_pools_tokens_and_shows_in_model_info():
    config = {"model": "llama-3.1-8b", "max_model_len": 4096, "max_num_seqs": 64}
    with SimulatedRunner(config, "h100-sxm").load_model() as bf16, \
            SimulatedRunner(config, Simulation("h100-sxm", kv_cache_dtype="fp8")).load_model() as fp8:
        half, full = fp8.memory_stats(), bf16.memory_stats()
        assert fp8.model_info()["simulation"]["kv_cache_dtype"] == "fp8"
        assert bf16.model_info()["simulation"]["kv_cache_dtype"] == "bfloat16"
        assert fp8.engine.cost_model.kv_cache_dtype == "fp8"
    assert half["kv_bytes_per_token"] * 2 == full["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert half["kv_pool_bytes"] == pytest.approx(full["kv_pool_bytes"], rel=1e-3)  # the same memory ...
    assert half["blocks_total"] == pytest.approx(2 * full["blocks_total"], abs=1)  # ... holds twice the tokens
    with pytest.raises(ValueError, match="kv_cache_dtype.*'fp8'"):
        Simulation("h100-sxm", kv_cache_dtype="int4")


def test_the_pool_of_a_tiny_model_on_a_big_gpu_is_capped_at_what_the_scheduler_can_hold():
    config = {"model": "tiny-llama", "max_model_len": 256, "max_num_seqs": 8, "block_size": 16}
    with SimulatedRunner(config, "h200").load_model() as runner:
        stats = runner.memory_stats()
        cap = 2 * 8 * 256 // 16
        assert runner.engine.memory.num_blocks == stats["kv_pool_blocks_simulated"] == cap
        assert stats["blocks_total"] > 1000 * cap  # the planned pool: the H200's memory less the weights
        assert stats["kv_pool_bytes"] == stats["blocks_total"] * 16 * stats["kv_bytes_per_token"]
        assert stats["blocks_free"] == stats["blocks_total"]
        outs = runner.generate([[5 + i] * 200 for i in range(10)], max_new_tokens=40, ignore_eos=True)
        assert [len(o.token_ids) for o in outs] == [40] * 10
        runner.reconfigure(max_num_seqs=16)  # the cap follows the scheduler's limit
        assert runner.engine.memory.num_blocks == 2 * cap
        assert runner.memory_stats()["blocks_total"] == pytest.approx(stats["blocks_total"], rel=1e-3)  # planned


def test_shutting_down_a_simulated_runner_does_not_release_freed_memory(monkeypatch):
    import runner_core.model_runner as model_runner

    calls = []
    monkeypatch.setattr(model_runner, "release_freed_memory", lambda: calls.append(1))
    runner = _tiny()
    runner.shutdown()
    assert calls == []
    ModelRunner({"model": "tiny-llama"}).shutdown()  # a real runner's does
    assert calls == [1]


def test_a_model_runner_given_simulate_names_the_simulated_runner():
    import runner_core.simulator

    with pytest.raises(ConfigError, match=r"runner_core\.simulator\.SimulatedRunner\(config, simulate\)"):
        ModelRunner({"model": "tiny-llama"}, simulate="h200")
    assert runner_core.simulator.SimulatedRunner is SimulatedRunner
    assert isinstance(SimulatedRunner({"model": "tiny-llama"}, "h200"), ModelRunner)
