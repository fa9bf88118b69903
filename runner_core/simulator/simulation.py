"""What a simulation runs on: the `Simulation` options (the hardware, its efficiency band, a weight format,
a KV cache format, the seed of the drawn tokens), resolved into a HardwareSpec and its Coefficients, and the
memory plan of a configuration on that hardware: `estimate_memory`'s per-device figures and the KV pool
`plan_pool` gives from the device's memory (on the CPU, as the real runner plans it), refused with a
ConfigError naming what would fit when one max_model_len sequence does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from runner_core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, RunnerConfig, dtype_bytes
from runner_core.memory import MemoryEstimate, PoolPlan, check_fits, estimate_memory, plan_pool, usable_memory_bytes
from runner_core.simulator.cost_model import KV_CACHE_DTYPES, WEIGHT_FORMATS, kv_element_bytes
from runner_core.simulator.hardware import BANDS, Coefficients, HardwareSpec, get_hardware

__all__ = ["WEIGHT_FORMATS", "Simulation", "estimate_on", "plan_memory", "simulated_config", "usable_bytes"]
# the storage estimate_memory counts for a weight format: fp8 is one byte a weight, as int8 (its row scales aside)
_STORED_AS = {"int8": "int8", "int4": "int4", "fp8": "int8"}


@dataclass(frozen=True)
class Simulation:
    """How to simulate: `hardware` a HARDWARE name, a HardwareSpec, or "cpu" (this machine's saved
    calibration); `band` which end of a GPU's efficiency band ("low" pessimistic .. "high" optimistic);
    `weight_format` the weights' format beyond the config's quantization ("int8", "int4", "fp8"; None: the
    config's); `kv_cache_dtype` the KV cache's element format (None: the compute dtype; "fp8": one byte an
    element, so the pool plans twice the tokens of a 16-bit cache and decode reads half the KV bytes); `seed`
    the drawn tokens'; `async_scheduling` whether the host's work of a step (scheduling, input preparation,
    sampling bookkeeping) runs while the device computes the previous one, as an engine with an overlap
    scheduler does (vLLM's --async-scheduling, TensorRT-LLM's PyTorch backend by default), so a step costs the
    larger of the two instead of their sum (False: this engine, which runs them one after the other).

    The real engine has no FP8 KV cache: kv_cache_dtype="fp8" is a what-if of an engine that has one (the
    scheduler and pool run as they do, over the larger pool; no quantization error is modelled)."""

    hardware: HardwareSpec | str = "cpu"
    band: str = "typical"
    weight_format: str | None = None
    seed: int = 0
    kv_cache_dtype: str | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.hardware, (HardwareSpec, str)):
            raise ValueError(f"Simulation.hardware must be a HardwareSpec or a device name, got {self.hardware!r}")
        if self.band not in BANDS:
            raise ValueError(f"Simulation.band {self.band!r} is unknown; use one of {', '.join(BANDS)}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"Simulation.weight_format {self.weight_format!r} is unknown; use None (the config's "
                             f"quantization) or one of {', '.join(map(repr, WEIGHT_FORMATS[1:]))}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Simulation.kv_cache_dtype {self.kv_cache_dtype!r} is unknown; use None (the compute "
                             f"dtype) or one of {', '.join(map(repr, KV_CACHE_DTYPES[1:]))}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Simulation.seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"Simulation.async_scheduling must be True or False, got {self.async_scheduling!r}")

    @classmethod
    def coerce(cls, value) -> Simulation:
        """A Simulation from itself, a HardwareSpec or a device name."""
        return value if isinstance(value, Simulation) else cls(hardware=value)

    def resolve(self) -> tuple[HardwareSpec, Coefficients]:
        """The hardware and the coefficients its steps take: a band's (GPU), else the spec's own
        (a calibrated CPU). "cpu" without a saved calibration: ValueError saying how to make one."""
        hardware = self.hardware
        if hardware == "cpu":
            from runner_core.simulator.calibration import load_calibration

            calibration = load_calibration()
            if calibration is None:
                raise ValueError("simulating this CPU needs its calibration, and none is saved: run `make "
                                 "bench-whatif` or runner_core.simulator.calibrate() first, or simulate a named "
                                 "device (hardware='h100-sxm', ...)")
            hardware = calibration.hardware
        hardware = get_hardware(hardware)
        return hardware, hardware.coefficients(self.band)

    def cost_format(self, config: RunnerConfig) -> str | None:
        """The weights' format the cost model reads: this simulation's, else the config's quantization."""
        return self.weight_format or config.quantization

    def info(self, hardware: HardwareSpec, coefficients: Coefficients, config: RunnerConfig) -> dict:
        """model_info()["simulation"]."""
        return {"hardware": hardware.name, "band": self.band if hardware.band else None,
                "devices": config.world_size, "weight_format": self.cost_format(config),
                "kv_cache_dtype": self.kv_cache_dtype or str(config.torch_dtype).removeprefix("torch."),
                "seed": self.seed, "async_scheduling": self.async_scheduling,
                "coefficients": coefficients.as_dict()}


def simulated_config(config: RunnerConfig, hardware: HardwareSpec) -> RunnerConfig:
    """`config` as it runs on `hardware`: on the CPU device (the simulated one is the hardware: no CUDA device
    is touched, none is counted for the ranks), dtype "auto" bfloat16 on a GPU (the CPU's own rule on a CPU)
    and an unset max_num_batched_tokens the GPU default."""
    changes = {"device": "cpu"} if config.device != "cpu" else {}
    if hardware.kind == "gpu":
        if config.dtype == "auto":
            changes["dtype"] = "bfloat16"
        if config.max_num_batched_tokens is None:
            changes["max_num_batched_tokens"] = max(config.max_num_seqs, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])
    return config.replace(**changes) if changes else config


def estimate_on(config: RunnerConfig, path: Path, hardware: HardwareSpec, weight_format: str | None,
                kv_cache_dtype: str | None = None) -> MemoryEstimate:
    """estimate_memory's figures per device for `config` (the model at `path`) on `hardware`, the KV cache's
    at `kv_cache_dtype`'s element size (what would fit, in the refusals, is still reckoned at the compute
    dtype's)."""
    quantization = _STORED_AS.get(weight_format, config.quantization)
    estimate = estimate_memory(
        path, dtype=config.torch_dtype, tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size, pipeline_stage_layers=config.pipeline_stage_layers,
        max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.effective_max_num_batched_tokens, block_size=config.block_size,
        kv_cache_memory=config.kv_cache_memory, device="cuda" if hardware.kind == "gpu" else "cpu",
        trust_remote_code=config.trust_remote_code, model_impl=config.model_impl, quantization=quantization,
        quantization_group_size=config.quantization_group_size, quantize_lm_head=config.quantize_lm_head)
    estimate.model = config.model  # what the refusals name: as given (a config model's name, not its cache path)
    element, compute = kv_element_bytes(kv_cache_dtype, config.torch_dtype), dtype_bytes(config.torch_dtype)
    if element == compute:
        return estimate
    per_token, bs = estimate.kv_bytes_per_token // compute * element, config.block_size
    tokens = (estimate.kv_pool_tokens if config.kv_cache_memory is None
              else config.kv_cache_memory // (per_token * bs) * bs)
    pool = tokens * per_token
    return replace(estimate, kv_bytes_per_token=per_token, kv_pool_bytes=pool, kv_pool_tokens=tokens,
                   min_kv_pool_bytes=estimate.min_kv_pool_bytes // compute * element,
                   total_per_device_bytes=estimate.total_per_device_bytes - estimate.kv_pool_bytes + pool)


def usable_bytes(config: RunnerConfig, hardware: HardwareSpec) -> int:
    """What the model may take of one device: a GPU's memory x gpu_memory_utilization less what is held
    outside the model (reserved_bytes); the CPU's available RAM, as the real runner reads it."""
    if hardware.kind == "gpu":
        return int(hardware.memory_bytes * config.gpu_memory_utilization) - hardware.reserved_bytes
    return usable_memory_bytes("cpu")


def plan_memory(config: RunnerConfig, estimate: MemoryEstimate, hardware: HardwareSpec) -> PoolPlan:
    """The KV pool of `config` on `hardware`: a GPU's memory less the estimate's weights, rotary tables and
    activation peak (per device; TP divides the KV heads, PP plans the largest stage), or on the CPU the
    real runner's rule (kv_cache_memory, else a share of the RAM). ConfigError when one max_model_len
    sequence does not fit, naming the need and the single changes that would fit (memory.fit)."""
    check_fits(estimate, usable_bytes(config, hardware), gpu_memory_utilization=config.gpu_memory_utilization)
    gpu = hardware.kind == "gpu"
    plan = plan_pool(bytes_per_token=estimate.kv_bytes_per_token, block_size=config.block_size,
                     max_model_len=estimate.max_model_len, max_num_seqs=config.max_num_seqs,
                     kv_cache_memory=config.kv_cache_memory, device="cuda" if gpu else "cpu",
                     gpu_memory_utilization=config.gpu_memory_utilization,
                     weights_bytes=estimate.weights_bytes + estimate.buffers_bytes,
                     activation_peak_bytes=estimate.activation_peak_bytes,
                     total_bytes=hardware.memory_bytes if gpu else None,
                     non_torch_bytes=hardware.reserved_bytes if gpu else None)
    plan.check_holds(estimate.max_model_len, f"on {hardware.name} ")
    return plan
