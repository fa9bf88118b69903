"""The simulated runner: the engine's real Scheduler, MemoryManager (prefix cache, preemption), output
processor and step observer on a virtual clock, the forward pass replaced by the cost model's predicted
step time and sampling by seeded draws that are never an EOS id. No weights are read and no ranks are
spawned: the model is its config.json, tensor and pipeline parallelism are simulated in this process.

`build_simulated_engine(config, simulation)` is what `SimulatedRunner(config, simulate).load_model()` calls
(`simulator.run.simulate_workload` is the one-call load run).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from runner_core.config import RunnerConfig, resolve_max_model_len
from runner_core.engine.clock import VirtualClock
from runner_core.engine.engine import LLMEngine
from runner_core.engine.input_processor import InputProcessor
from runner_core.engine.threads import ThreadTuner, usable_cores
from runner_core.engine.worker import LocalExecutor
from runner_core.errors import ConfigError, InvalidRequestError
from runner_core.layers.sampler import SamplerOutput
from runner_core.loader.model_loader import read_hf_config
from runner_core.loader.tokenizer import has_tokenizer_files, load_tokenizer
from runner_core.memory import MemoryManager, ModelShape, PoolPlan
from runner_core.models import MODEL_REGISTRY
from runner_core.models.catalogue import resolve_model
from runner_core.parallel.plan import validate_parallel_config
from runner_core.simulator.cost_model import CostModel
from runner_core.simulator.hardware import HardwareSpec
from runner_core.simulator.simulation import Simulation, estimate_on, plan_memory, simulated_config

NO_LOGITS = ("a simulated runner computes no logits (it predicts step times; no weights are loaded); load the "
             "model with ModelRunner to run forward passes")


def simulated_blocks(plan: PoolPlan, config: RunnerConfig) -> int:
    """The blocks a simulated pool gets: the plan's, capped at twice what the scheduler can ever hold at once
    (max_num_seqs sequences of max_model_len tokens): the first half for the running sequences, the rest room
    for cached prefixes. A tiny model on a big GPU plans millions of blocks (tiny-llama on an H200: 8.2M, a
    33 s BlockPool build) that no schedule can reach; past the cap, only prefix-cache hits on prefixes older
    than that room differ from the uncapped pool."""
    cap = 2 * -(-config.max_num_seqs * plan.max_model_len // plan.block_size)
    return min(plan.num_blocks, cap)


class SimulatedWorker:
    """What the engine reads from a worker, without a model: a MemoryManager over the planned KV pool (no KV
    tensor; its blocks capped by `simulated_blocks`), the vocabulary and max_model_len, the memory figures of
    the estimate and the plan (the planned pool's, whatever the cap). A LocalExecutor runs it."""

    encoder_cache = None
    model = None  # no weights

    def __init__(self, config: RunnerConfig, hf_config, path: Path, hardware: HardwareSpec,
                 weight_format: str | None, kv_cache_dtype: str | None = None):
        self.config, self.hf_config, self.path = config, hf_config, path
        self.hardware, self.weight_format, self.kv_cache_dtype = hardware, weight_format, kv_cache_dtype
        self.device, self.dtype = torch.device("cpu"), config.torch_dtype  # the device of the engine's tensors
        text = hf_config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_model_len = resolve_max_model_len(config.max_model_len, text.max_position_embeddings)
        self.is_moe = ModelShape.from_hf_config(hf_config).moe is not None
        self.compile = {"enabled": False, "backend": None, "mode": None, "scope": None}
        self.estimate, plan = self._plan(config)
        self._allocate_pool(plan)

    def _plan(self, config: RunnerConfig):
        estimate = estimate_on(config, self.path, self.hardware, self.weight_format, self.kv_cache_dtype)
        return estimate, plan_memory(config, estimate, self.hardware)

    def _allocate_pool(self, plan: PoolPlan) -> None:
        self.pool_plan, blocks = plan, simulated_blocks(plan, self.config)
        self.memory = MemoryManager(blocks, plan.block_size, self.config.enable_prefix_caching)
        self.unsimulated_blocks = plan.num_blocks - blocks  # planned, left out by the cap

    def reconfigure(self, config: RunnerConfig, groups: tuple[str, ...]) -> dict:
        """Run under `config` (a live change): the pool re-planned from a new estimate (its activation peak
        follows the scheduler's limits), rebuilt when its settings changed or the plan's size did (as the
        real worker: larger, or on a GPU smaller too; or the simulated blocks' cap did). Raises ConfigError with
        nothing changed."""
        check_not_speculative(config)
        estimate, plan = self._plan(config)
        planned, blocks = self.planned_blocks, simulated_blocks(plan, config)
        rebuild = ("pool" in groups or plan.num_blocks > planned or blocks != self.memory.num_blocks
                   or (self.hardware.kind == "gpu" and plan.num_blocks < planned))
        self.config, self.estimate = config, estimate
        if rebuild:
            self._allocate_pool(plan)
        return {"pool": rebuild}

    def set_compile_mode(self, enabled: bool, backend: str | None = None, mode: str | None = None,
                         scope: str | None = None) -> dict:
        """Recorded only: the cost model's coefficients already say how fast the steps run."""
        config = self.config
        self.compile = {"enabled": enabled, "backend": backend or config.compile_backend,
                        "mode": mode or config.compile_mode, "scope": scope or config.compile_scope}
        return self.compile_stats()

    def compile_stats(self) -> dict:
        return {**self.compile, "cache": "off", "compile_seconds": {}, "recompiles_after_warmup": 0,
                "graph_breaks": 0, "warm_start": None, "cuda_graphs": None,
                "simulated": "recorded only: the step times come from the cost model's coefficients"}

    @property
    def planned_blocks(self) -> int:
        """The planned pool's blocks: the simulated ones plus those the cap left out."""
        return self.memory.num_blocks + self.unsimulated_blocks

    def memory_bytes(self) -> dict:
        """Worker.memory_bytes()'s keys from the estimate and the plan, per device, + the device's memory; the
        KV pool's bytes are the planned pool's."""
        plan = self.pool_plan
        return {"weights_bytes": self.estimate.weights_bytes,
                "kv_pool_bytes": self.planned_blocks * plan.block_size * plan.bytes_per_token,
                "kv_bytes_per_token": plan.bytes_per_token, "activation_peak_bytes": plan.activation_peak_bytes,
                "decode_programs_bytes": 0, "device_memory_bytes": self.hardware.memory_bytes}

    def move_kv_blocks(self, moves: dict[int, int], num_blocks: int) -> None:
        self.memory.move_blocks(moves)
        self.memory.shrink(num_blocks)
        self.unsimulated_blocks = 0  # a pool shrunk to a size: that size, as the real worker's

    def execute_model(self, batch):
        raise InvalidRequestError(NO_LOGITS)

    def run_stateless(self, rows, output_router_logits: bool = False):
        raise InvalidRequestError(NO_LOGITS)


class SimulatedInputs(InputProcessor):
    """Prompts as token ids; text only where the config directory ships a tokenizer."""

    def _encode_text(self, prompt):
        if isinstance(prompt, str) and self.tokenizer is None:
            raise InvalidRequestError(f"this simulated model ({self.model_name}) has no tokenizer (its config "
                                      "directory holds none): give prompts as token ids")
        return super()._encode_text(prompt)


class SimulatedEngine(LLMEngine):
    """LLMEngine whose model run advances a VirtualClock by `cost_model.step_time` and draws the tokens."""

    def __init__(self, config: RunnerConfig, worker: SimulatedWorker, hf_config, adapter, tokenizer,
                 eos_token_ids, cost_model: CostModel, simulation: Simulation, info: dict, dtype_reason: str):
        check_not_speculative(config)
        self._setup(config, worker, LocalExecutor(worker), tokenizer, hf_config, VirtualClock(), None)
        self.inputs = SimulatedInputs(tokenizer, self.vocab_size, adapter.architecture)
        self.cost_model, self.simulation = cost_model, simulation
        estimate = worker.estimate
        devices = info["devices"]
        self.model_info = {
            "architecture": adapter.architecture, "model_impl": adapter.impl, "kind": adapter.kind,
            "model_class": adapter.model_class.__name__, "reason": adapter.reason, "model_path": str(worker.path),
            "num_parameters": sum(math.prod(s) for _, s in estimate.inputs.tensors),
            "weights_bytes": estimate.weights_bytes, "dtype": str(worker.dtype).removeprefix("torch."),
            "dtype_reason": dtype_reason,
            "device": f"simulated {worker.hardware.name} x{devices}", "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size, "cpu_kernels": None, "quantization": None, "simulation": info}
        self.threads = ThreadTuner(*usable_cores(), None, "simulated: the steps' times are predicted, not run",
                                   adaptive=False)
        self.model_info["threads"] = self.threads.info()
        self._eos = sorted(e for e in eos_token_ids if 0 <= e < self.vocab_size)
        self._generator = torch.Generator().manual_seed(simulation.seed)

    def add_request(self, prompt, params=None, request_id=None, stream=False, metrics=None):
        if params is not None and getattr(params, "stop", None):
            raise InvalidRequestError(f"stop strings {params.stop!r} need text, and a simulated runner makes none "
                                      "(its tokens are drawn); use max_tokens or stop_token_ids")
        seq = super().add_request(prompt, params, request_id, stream, metrics)
        seq.logprobs = None  # no logits: logprobs give None
        return seq

    def _run_model(self, batch, seqs, ordered=None):
        self.clock.advance(self.cost_model.step_time(batch.starts, batch.num_new_tokens, len(seqs)))
        sampled = SamplerOutput(self._draw(len(seqs)), None, None) if seqs else None
        return sampled, [], 0.0, None, self.clock.now()

    def _draw(self, n: int) -> torch.Tensor:
        """n token ids, uniform over the vocabulary less its EOS ids."""
        ids = torch.randint(self.vocab_size - len(self._eos), (n,), generator=self._generator)
        for e in self._eos:  # ascending: each draw at or above an EOS id moves one up, past it
            ids += ids >= e
        return ids

    def forward_stateless(self, rows, output_router_logits: bool = False):
        raise InvalidRequestError(NO_LOGITS)

    def moe_stats(self, recent_steps: int = 64) -> dict:
        raise InvalidRequestError("a simulated runner routes no tokens (the cost model counts the experts a step "
                                  "reads from the batch's shape); load the model with ModelRunner for moe_stats")

    def memory_stats(self) -> dict:
        """The real runner's keys, the pool's blocks as planned (the cap's left-out blocks count as free) and,
        where the cap left some out, "kv_pool_blocks_simulated": the blocks the scheduler runs on."""
        stats = {**super().memory_stats(), "device": self.model_info["device"]}
        extra = self.worker.unsimulated_blocks
        if extra:
            stats.update(kv_pool_blocks_simulated=stats["blocks_total"], blocks_total=stats["blocks_total"] + extra,
                         blocks_free=stats["blocks_free"] + extra)
        return stats


def build_simulated_engine(config: RunnerConfig, simulation: Simulation) -> SimulatedEngine:
    """The engine of `SimulatedRunner(config, simulate)`: config.model resolved by the models' catalogue (a
    config-only model, a preset or a directory with config.json), its config read, the layout validated (a split the
    model cannot take is refused), the pool planned on the hardware (ConfigError when it cannot fit)."""
    hardware, coefficients = simulation.resolve()
    path = resolve_model(config.model)
    auto = config.dtype == "auto"
    config = simulated_config(config, hardware)  # on a GPU, dtype "auto" is bfloat16 from here on
    dtype_reason = "set in the config" if not auto else (
        "auto: bfloat16 on a GPU" if hardware.kind == "gpu" else f"auto: {config.auto_dtype()[1]}")
    hf_config = read_hf_config(path, config.trust_remote_code)
    shape = ModelShape.from_hf_config(hf_config)
    stages = validate_parallel_config(config, hf_config) if config.world_size > 1 else [range(shape.num_layers)]
    adapter = MODEL_REGISTRY.get_adapter(hf_config, config.model_impl, trust_remote_code=config.trust_remote_code,
                                         tensor_parallel_size=config.tensor_parallel_size,
                                         pipeline_parallel_size=config.pipeline_parallel_size)
    weight_format = simulation.cost_format(config)
    worker = SimulatedWorker(config, hf_config, path, hardware, simulation.weight_format, simulation.kv_cache_dtype)
    cost_model = CostModel(shape, hardware, coefficients, dtype=str(worker.dtype).removeprefix("torch."),
                           weight_format=weight_format, tensor_parallel_size=config.tensor_parallel_size,
                           pipeline_parallel_size=config.pipeline_parallel_size,
                           pipeline_stage_layers=[len(r) for r in stages], kv_cache_dtype=simulation.kv_cache_dtype,
                           host_overlap=simulation.async_scheduling)
    # the EOS ids (config.json's, generation_config.json's, the tokenizer's) the drawn tokens avoid; text needs
    # the directory's own tokenizer (the byte fallback would read text no real tokenizer of the model reads)
    tokenizer = load_tokenizer(path, hf_config, config.trust_remote_code)
    return SimulatedEngine(config, worker, hf_config, adapter, tokenizer if has_tokenizer_files(path) else None,
                           tokenizer.eos_token_ids, cost_model, simulation,
                           simulation.info(hardware, coefficients, config), dtype_reason)


def check_not_speculative(config: RunnerConfig) -> None:
    """Refuse speculative decoding: the simulated steps draw tokens, so no draft would be accepted; speculation is
    priced in expectation, from an acceptance rate, by runner_core.simulator.speculation."""
    if config.speculative_config is not None:
        raise ConfigError("config field 'speculative_config' is set for a simulated runner: its steps draw tokens, "
                          "which no draft matches; simulate with speculative_config=None and price speculation with "
                          "runner_core.simulator.speculation_sweep(config, hardware, ks=..., acceptance_rates=...)")
