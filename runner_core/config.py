"""`RunnerConfig`: every setting of the runner (the seed's Appendix A plus engine
fields), built from a dict or keyword arguments and validated up front.

Each bad value raises `ConfigError` naming the field, the value and what is allowed.
Change a field through `replace()`, which validates again.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from runner_core.errors import ConfigError
from runner_core.layers.attention import ATTENTION_BACKENDS
from runner_core.spec_decode.config import check_speculative_config

logger = logging.getLogger("runner_core")

# ---- shared constants: the one home of the choices config, compile, memory and the dashboard offer
# Token budget per step when unset: on the CPU, smaller chunks keep the GEMMs cache-friendly
# (benchmarks/throughput.py measured 256-1024 ahead of 2048 on the 2-core test machine).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 2048, "cpu": 512}
MODEL_IMPLS = ("auto", "native", "transformers")  # auto: a native adapter when registered, else the fallback
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # the common ones; any registered dynamo backend is accepted
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "auto")
COMPILE_SCOPES = ("model", "layer", "mlp", "self_attn")  # whole model, each decoder layer, module kinds
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor captures its own CUDA graphs in these
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
QUANTIZATIONS = (None, "int8", "int4")  # weight storage formats (layers/quantization.py); None: the compute dtype
QUANT_GROUP_SIZES = (32, 64, 128)  # int4: weights along k sharing one scale and minimum
# how attention reads the KV pool; auto: flex on CUDA, the native kernel on the CPU when built, else gather
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# what a loaded runner changes without reloading a weight (ModelRunner.reconfigure), by what the change rebuilds
RECONFIGURABLE = {"scheduler": ("max_num_seqs", "max_num_batched_tokens", "speculative_config"),
                  "pool": ("block_size", "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching"),
                  "compile": ("compile", "compile_backend", "compile_mode", "compile_scope", "enforce_eager")}

_DTYPES = {"auto": "auto", "float16": "float16", "half": "float16", "fp16": "float16", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float32": "float32", "float": "float32", "fp32": "float32"}
_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")


def project_version() -> str:
    """The installed runner-workbench distribution's version ("0+unknown" for a bare source tree)."""
    try:
        return importlib.metadata.version("runner-workbench")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype given by name ('auto' is not a dtype: resolve it first) or torch.dtype."""
    if not isinstance(dtype, torch.dtype):
        dtype = TORCH_DTYPES[normalise_dtype(dtype)]
    return torch.empty((), dtype=dtype).element_size()


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """`max_model_len` for a model: as requested (at most the model's positions), else the model's."""
    wanted = requested or max_position_embeddings
    if wanted > max_position_embeddings:
        raise ConfigError(f"max_model_len={wanted} exceeds the model's max_position_embeddings="
                          f"{max_position_embeddings}; use max_model_len <= {max_position_embeddings}")
    return wanted


def _bad(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {name!r} got {value!r}; allowed: {allowed}")


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "True or False")
    return value


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise _bad(name, value, allowed)
    return value


def _check_choice(name: str, value: Any, choices: tuple) -> Any:
    if not any(type(value) is type(c) and value == c for c in choices):
        raise _bad(name, value, "one of " + ", ".join(map(repr, choices)))
    return value


def _check_str(name: str, value: Any, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise _bad(name, value, "a non-empty string" + (" or None" if optional else ""))
    return value


def normalise_dtype(value: Any) -> str:
    """The canonical name ('float32', 'bfloat16', 'float16' or 'auto') of a dtype given by name or torch.dtype."""
    if isinstance(value, torch.dtype):
        for name, dtype in TORCH_DTYPES.items():
            if value == dtype:
                return name
    elif isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    allowed = ", ".join(map(repr, _DTYPES)) + " or torch.float16/bfloat16/float32"
    raise _bad("dtype", value, allowed)


def _normalise_device(value: Any) -> int | str:
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and (value == "cpu" or _CUDA_DEVICE.fullmatch(value)):
        return value
    raise _bad("device", value, "a GPU index >= 0, 'cpu', 'cuda' or 'cuda:N'")


def auto_dtype(device_type: str, checkpoint_dtype: str | None = None) -> tuple[str, str]:
    """What dtype="auto" becomes on a device type, and why: on CUDA bfloat16 (as the simulator takes it; float16
    overflows bf16-trained checkpoints), float16 only on a visible GPU without bfloat16. On the CPU with the native
    kernels: bfloat16 where their tier multiplies it natively (AVX512-BF16); else a bfloat16 checkpoint
    (`checkpoint_dtype`) stays bfloat16 (every tier reads bfloat16 and computes in float32 registers: half a
    float32 copy's memory) and anything else is float32. Without the kernels, bfloat16 where torch's matmuls are
    native (AVX512-BF16 or AMX), else float32 (emulated, slow). RUNNER_CORE_CPU_BF16=1 or 0 overrides the CPU
    check (the tests pin it, so they run alike anywhere)."""
    if device_type == "cuda":
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "float16", "this CUDA device has no bfloat16 (before Ampere)"
        return "bfloat16", "a CUDA device (bfloat16, the dtype most checkpoints are trained in)"
    forced = os.environ.get("RUNNER_CORE_CPU_BF16")
    if forced is not None and forced not in ("0", "1"):
        raise ConfigError(f"environment variable RUNNER_CORE_CPU_BF16={forced!r}; allowed: '1' (dtype auto is "
                          "bfloat16 on the CPU), '0' (float32), or unset (decided by the CPU's instructions)")
    if forced:
        return ("bfloat16", "RUNNER_CORE_CPU_BF16=1") if forced == "1" else ("float32", "RUNNER_CORE_CPU_BF16=0")
    from runner_core.kernels import cpu_kernels_available, kernel_info

    if cpu_kernels_available():
        kernels = kernel_info()
        if kernels["native_bf16"]:
            return "bfloat16", f"the {kernels['tier']} kernels multiply bfloat16 natively"
        if checkpoint_dtype == "bfloat16":
            return "bfloat16", (f"the checkpoint is bfloat16 and the {kernels['tier']} kernels read it as bfloat16, "
                                "computing in float32 registers (half the memory of a float32 copy)")
        return "float32", (f"the {kernels['tier']} kernels have no native bfloat16 products and the checkpoint is "
                           f"{checkpoint_dtype or 'not known to be bfloat16'}")
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return "bfloat16", "this CPU has native bfloat16 matmuls (AVX512-BF16 or AMX)"
    return "float32", "no native kernels, and this CPU has no AVX512-BF16 or AMX: bfloat16 would be emulated"


def checkpoint_dtype(model: str | Path) -> str | None:
    """The dtype a checkpoint's weights are stored in (config.json's torch_dtype), where it can be read
    without loading anything: a preset, or a local model directory; None otherwise."""
    from runner_core.models.presets import is_preset, stored_dtype

    if isinstance(model, str) and is_preset(model):
        return stored_dtype(model)
    try:
        raw = json.loads((Path(model).expanduser() / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    value = raw.get("torch_dtype") or raw.get("dtype") if isinstance(raw, dict) else None
    return value if isinstance(value, str) and value in TORCH_DTYPES else None


def _resolve_device(device: int | str) -> torch.device:
    """The torch.device to run on. Without CUDA a GPU index (the default 0) falls back to the CPU (one
    info line); a CUDA device named explicitly ('cuda', 'cuda:N') is refused: it would run on the CPU unnoticed."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if isinstance(device, str):
            raise ConfigError(f"config field 'device' got {device!r}, but torch sees no CUDA device here (torch "
                              f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device='cpu', "
                              "or run where torch.cuda.is_available() is True (a CUDA torch and a visible GPU)")
        logger.info("CUDA is not available; device=%r falls back to the CPU", device)
        return torch.device("cpu")
    if isinstance(device, int):
        index = device
    else:
        match = _CUDA_DEVICE.fullmatch(device)
        index = int(match.group(1)) if match.group(1) else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise _bad("device", device, f"a CUDA index below {count} (devices visible: {count})")
    return torch.device("cuda", index)


def _check_backend(value: Any) -> str:
    if value in COMPILE_BACKENDS:
        return value
    import torch._dynamo

    known = sorted(set(COMPILE_BACKENDS) | set(torch._dynamo.list_backends()))
    if not isinstance(value, str) or value not in known:
        raise _bad("compile_backend", value, "one of " + ", ".join(map(repr, known)))
    return value


def _check_number(name: str, value: Any, low: float, high: float, allowed: str) -> float:
    """A number in (low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise _bad(name, value, allowed)
    return float(value)


def _check_stage_layers(value: Any, pp: int) -> list | None:
    if value is None:
        return None
    ok = (isinstance(value, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                   for n in value))
    if not ok or len(value) != pp:
        raise _bad("pipeline_stage_layers", value, f"None (an even split) or a list of {pp} ints >= 1, the "
                                                   "decoder layers of each pipeline stage, first to last")
    return list(value)


def _check_sizes(value: Any) -> list | None:
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                  for n in value)
    if not ok:
        raise _bad("compile_sizes", value, "None (the device's default), [] (none) or a list of ints >= 1, "
                                           "the decode batch sizes that get a static program")
    return sorted(set(value))


@dataclass(init=False)
class RunnerConfig:
    """Validated runner settings; build with kwargs, a dict, `from_dict` or `coerce`."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: int | str = 0
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str = "auto"  # CUDA: "default" + the runner's decode CUDA graphs; CPU: "max-autotune"
    compile_cache_dir: str = "./compile_cache"
    compile_scope: str = "model"
    compile_fallback: bool = True
    # pure-decode batch sizes given a static program (CPU: weight-frozen inductor compile; CUDA: a CUDA graph); a
    # decode batch runs at the next size up. None: [1] on CPU, 1, 2, 4, 8, 16, 32, ... up to max_num_seqs; []: none
    compile_sizes: list | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_stage_layers: list | None = None  # decoder layers per stage, first to last; None: even
    parallel_timeout_s: float = 120.0  # a worker silent this long in a step is declared hung
    trust_remote_code: bool = False
    model_impl: str = "auto"  # which adapter path builds the model (models/registry.py)
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    attention_backend: str = "auto"  # ATTENTION_BACKENDS; resolved per device by engine/forward_pass.py
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = False
    # image-feature rows the encoder cache keeps (multimodal models); None: max_num_batched_tokens; 0: none
    encoder_cache_tokens: int | None = None
    enforce_eager: bool = False
    # CPU threads of the steps; None: RUNNER_CORE_THREADS, else adapted to load (engine/threads.py)
    cpu_threads: int | None = None
    # how linear weights are stored (layers/quantization.py): None (the compute dtype), "int8" (one scale
    # per output channel) or "int4" (groups of quantization_group_size along k, with a scale and a minimum);
    # a checkpoint quantized by this project sets it from its config.json
    quantization: str | None = None
    quantization_group_size: int = 64
    quantize_lm_head: bool = False  # the LM head too (and a tied embedding reads its rows from it)
    speculative_config: dict | None = None  # None (off) or vLLM's dict: runner_core/spec_decode/config.py
    seed: int = 0

    def __init__(self, config: RunnerConfig | Mapping[str, Any] | None = None, /, **kwargs: Any):
        if config is None:
            values: dict[str, Any] = {}
        elif isinstance(config, RunnerConfig):
            values = config.to_dict()
        elif isinstance(config, Mapping):
            values = dict(config)
        else:
            raise ConfigError(f"RunnerConfig takes a dict or a RunnerConfig, got {type(config).__name__} {config!r}")
        values.update(kwargs)
        known = [f.name for f in fields(RunnerConfig)]
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
                raise ConfigError(f"unknown config key {key!r}{hint}")
        if "model" not in values:
            raise ConfigError("config key 'model' is required: a local HF directory, a preset name "
                              "('tiny-llama', 'small-llama') or a hub id")
        for f in fields(RunnerConfig):
            setattr(self, f.name, values.get(f.name, f.default))
        self._validate()

    def _validate(self) -> None:
        self.model = _check_str("model", self.model)
        self.tokenizer = _check_str("tokenizer", self.tokenizer, optional=True)
        self.dtype = normalise_dtype(self.dtype)
        self.device = _normalise_device(self.device)
        self.compile = _check_bool("compile", self.compile)
        self.compile_backend = _check_backend(self.compile_backend)
        self.compile_mode = _check_choice("compile_mode", self.compile_mode, COMPILE_MODES)
        self.compile_cache_dir = _check_str("compile_cache_dir", self.compile_cache_dir)
        self.compile_scope = _check_choice("compile_scope", self.compile_scope, COMPILE_SCOPES)
        self.compile_fallback = _check_bool("compile_fallback", self.compile_fallback)
        self.compile_sizes = _check_sizes(self.compile_sizes)
        self.tensor_parallel_size = _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        self.pipeline_parallel_size = _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        self.pipeline_stage_layers = _check_stage_layers(self.pipeline_stage_layers, self.pipeline_parallel_size)
        self.parallel_timeout_s = _check_number("parallel_timeout_s", self.parallel_timeout_s, 0, float("inf"),
                                               "a number of seconds > 0")
        self.trust_remote_code = _check_bool("trust_remote_code", self.trust_remote_code)
        self.model_impl = _check_choice("model_impl", self.model_impl, MODEL_IMPLS)
        self.gpu_memory_utilization = _check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1,
                                                   "a number in (0, 1]")
        self.max_model_len = _check_int("max_model_len", self.max_model_len, 1, optional=True)
        self.max_num_seqs = _check_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_num_batched_tokens = _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, True)
        self.block_size = _check_choice("block_size", self.block_size, BLOCK_SIZES)
        self.attention_backend = _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        self.kv_cache_memory = _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        self.enable_prefix_caching = _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        self.encoder_cache_tokens = _check_int("encoder_cache_tokens", self.encoder_cache_tokens, 0, optional=True)
        self.enforce_eager = _check_bool("enforce_eager", self.enforce_eager)
        self.cpu_threads = _check_int("cpu_threads", self.cpu_threads, 1, optional=True)
        self.quantization = _check_choice("quantization", self.quantization, QUANTIZATIONS)
        self.quantization_group_size = _check_choice("quantization_group_size", self.quantization_group_size,
                                                     QUANT_GROUP_SIZES)
        self.quantize_lm_head = _check_bool("quantize_lm_head", self.quantize_lm_head)
        self.seed = _check_int("seed", self.seed, 0)
        self.speculative_config = check_speculative_config(self)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"config field 'max_num_batched_tokens' got {self.max_num_batched_tokens!r}; allowed: "
                f"an int >= max_num_seqs ({self.max_num_seqs}), since a decode step of every running "
                "sequence needs one token each")
        self._torch_device = _resolve_device(self.device)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> RunnerConfig:
        return cls(config)

    @classmethod
    def coerce(cls, obj: RunnerConfig | Mapping[str, Any] | None = None, **overrides: Any) -> RunnerConfig:
        """A new validated config from a RunnerConfig, a dict or None, with `overrides` applied."""
        return cls(obj, **overrides)

    def replace(self, **changes: Any) -> RunnerConfig:
        return type(self)(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    @property
    def world_size(self) -> int:
        """Processes a parallel runner uses: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.auto_dtype()[0] if self.dtype == "auto" else self.dtype]

    def auto_dtype(self) -> tuple[str, str]:  # what dtype="auto" means for this model on this device, and why
        if "_checkpoint_dtype" not in self.__dict__:
            self._checkpoint_dtype = checkpoint_dtype(self.model) if self._torch_device.type == "cpu" else None
        return auto_dtype(self._torch_device.type, self._checkpoint_dtype)

    @property
    def effective_encoder_cache_tokens(self) -> int:
        return self.effective_max_num_batched_tokens if self.encoder_cache_tokens is None else self.encoder_cache_tokens

    @property
    def effective_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is None:
            return max(self.max_num_seqs, DEFAULT_MAX_NUM_BATCHED_TOKENS.get(self.torch_device.type, 2048))
        return self.max_num_batched_tokens
