"""RunnerConfig: defaults, construction forms, validation messages, device/dtype resolution."""

import json
import logging
import math
import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runner_core import ModelRunner, kernels
from runner_core.config import RunnerConfig, auto_dtype
from runner_core.errors import ConfigError
from tests.helpers import native_kernels_off

DEFAULTS = {
    "model": "tiny-llama",
    "tokenizer": None,
    "dtype": "auto",
    "device": 0,
    "compile": False,
    "compile_backend": "inductor",
    "compile_mode": "auto",
    "compile_cache_dir": "./compile_cache",
    "compile_scope": "model",
    "compile_fallback": True,
    "compile_sizes": None,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "pipeline_stage_layers": None,
    "parallel_timeout_s": 120.0,
    "trust_remote_code": False,
    "model_impl": "auto",
    "gpu_memory_utilization": 0.9,
    "max_model_len": None,
    "max_num_seqs": 256,
    "max_num_batched_tokens": None,
    "block_size": 16,
    "attention_backend": "auto",
    "kv_cache_memory": None,
    "enable_prefix_caching": False,
    "encoder_cache_tokens": None,
    "enforce_eager": False,
    "cpu_threads": None,
    "quantization": None,
    "quantization_group_size": 64,
    "quantize_lm_head": False,
    "speculative_config": None,
    "seed": 0,
}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_defaults_match_the_table():
    config = RunnerConfig(model="tiny-llama")
    assert config.to_dict() == DEFAULTS
    assert config.effective_max_num_batched_tokens == 512  # the CPU default


def test_construction_forms_agree():
    base = RunnerConfig(model="tiny-llama", dtype="float32")
    assert RunnerConfig({"model": "tiny-llama", "dtype": "float32"}) == base
    assert RunnerConfig.from_dict({"model": "tiny-llama", "dtype": "float32"}) == base
    assert RunnerConfig.coerce({"model": "tiny-llama"}, dtype="float32") == base
    assert RunnerConfig.coerce(None, model="tiny-llama", dtype="float32") == base
    assert RunnerConfig({"model": "other"}, model="tiny-llama", dtype="float32") == base
    assert RunnerConfig(base) == base


def test_coerce_returns_a_new_validated_config():
    base = RunnerConfig(model="tiny-llama")
    copy = RunnerConfig.coerce(base)
    assert copy == base and copy is not base
    bigger = RunnerConfig.coerce(base, max_num_seqs=8, block_size=32)
    assert (bigger.max_num_seqs, bigger.block_size, bigger.model) == (8, 32, "tiny-llama")
    assert base.max_num_seqs == 256
    with pytest.raises(ConfigError, match="block_size"):
        RunnerConfig.coerce(base, block_size=3)


def test_replace_validates_and_keeps_the_original():
    base = RunnerConfig(model="tiny-llama")
    changed = base.replace(seed=7, dtype="bf16")
    assert (changed.seed, changed.dtype, base.seed) == (7, "bfloat16", 0)
    with pytest.raises(ConfigError, match="seed"):
        base.replace(seed=-1)


def test_to_dict_round_trips():
    config = RunnerConfig(model="m", max_model_len=512, kv_cache_memory=1 << 20, device="cpu")
    assert RunnerConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("build", [
    lambda: RunnerConfig(model="m", max_num_seq=4),
    lambda: RunnerConfig({"model": "m", "max_num_seq": 4}),
    lambda: RunnerConfig.from_dict({"model": "m", "max_num_seq": 4}),
    lambda: RunnerConfig.coerce({"model": "m"}, max_num_seq=4),
    lambda: RunnerConfig(model="m").replace(max_num_seq=4),
])
def test_unknown_key_suggests_the_closest_field(build):
    with pytest.raises(ConfigError, match=r"unknown config key 'max_num_seq'; did you mean 'max_num_seqs'\?"):
        build()


def test_unknown_key_without_a_close_match_lists_the_fields():
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'.*known keys: model, tokenizer"):
        RunnerConfig(model="m", zzz=1)


@pytest.mark.parametrize("values", [{}, {"dtype": "float32"}])
def test_missing_model(values):
    with pytest.raises(ConfigError, match="'model' is required"):
        RunnerConfig(values)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="takes a dict or a RunnerConfig, got list"):
        RunnerConfig(["model"])


BAD_VALUES = [
    ("model", "", "a non-empty string"),
    ("model", 3, "a non-empty string"),
    ("tokenizer", "", "a non-empty string or None"),
    ("dtype", "float8", "'auto', 'float16'"),
    ("dtype", torch.int8, "torch.float16/bfloat16/float32"),
    ("dtype", None, "'bfloat16'"),
    ("device", -1, "a GPU index >= 0, 'cpu', 'cuda' or 'cuda:N'"),
    ("device", "tpu", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", "cuda:x", "'cuda:N'"),
    ("device", True, "a GPU index >= 0"),
    ("device", 1.0, "a GPU index >= 0"),
    ("compile", "yes", "True or False"),
    ("compile", 1, "True or False"),
    ("compile_backend", "nope", "'aot_eager', "),
    ("compile_mode", "fast", "'default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs', 'auto'"),
    ("compile_cache_dir", "", "a non-empty string"),
    ("compile_scope", "everything", "'model', 'layer', 'mlp', 'self_attn'"),
    ("model_impl", "hf", "'auto', 'native', 'transformers'"),
    ("encoder_cache_tokens", -1, "an int >= 0 or None"),
    ("compile_fallback", "no", "True or False"),
    ("tensor_parallel_size", 0, "an int >= 1"),
    ("tensor_parallel_size", 2.0, "an int >= 1"),
    ("pipeline_parallel_size", True, "an int >= 1"),
    ("trust_remote_code", None, "True or False"),
    ("gpu_memory_utilization", 0, "a number in (0, 1]"),
    ("gpu_memory_utilization", 1.5, "a number in (0, 1]"),
    ("gpu_memory_utilization", math.nan, "a number in (0, 1]"),
    ("gpu_memory_utilization", "0.9", "a number in (0, 1]"),
    ("max_model_len", 0, "an int >= 1 or None"),
    ("max_num_seqs", 0, "an int >= 1"),
    ("max_num_seqs", None, "an int >= 1"),
    ("max_num_batched_tokens", -5, "an int >= 1 or None"),
    ("block_size", 3, "one of 1, 2, 4, 8, 16, 32, 64, 128"),
    ("block_size", 16.0, "one of 1, 2, 4, 8, 16, 32, 64, 128"),
    ("attention_backend", "triton", "one of 'auto', 'flex', 'native', 'gather'"),
    ("kv_cache_memory", 0, "an int >= 1 or None"),
    ("enable_prefix_caching", "true", "True or False"),
    ("enforce_eager", 0, "True or False"),
    ("seed", -1, "an int >= 0"),
]


@pytest.mark.parametrize("field, value, allowed", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_bad_value_names_field_value_and_allowed(field, value, allowed):
    values = {"model": "m", field: value}
    with pytest.raises(ConfigError) as info:
        RunnerConfig(values)
    message = str(info.value)
    assert repr(field) in message
    assert repr(value) in message
    assert allowed in message


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        RunnerConfig(model="m", seed=-1)


def test_batched_tokens_below_num_seqs():
    with pytest.raises(ConfigError, match=r"'max_num_batched_tokens' got 8.*>= max_num_seqs \(16\).*one token each"):
        RunnerConfig(model="m", max_num_seqs=16, max_num_batched_tokens=8)
    config = RunnerConfig(model="m", max_num_seqs=16, max_num_batched_tokens=16)
    assert config.effective_max_num_batched_tokens == 16


@pytest.mark.parametrize("value, canonical", [
    ("auto", "auto"), ("float16", "float16"), ("half", "float16"), ("fp16", "float16"),
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("float32", "float32"), ("float", "float32"),
    ("fp32", "float32"), ("FP16", "float16"),
    (torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
])
def test_dtype_aliases_normalise(value, canonical):
    assert RunnerConfig(model="m", dtype=value).dtype == canonical


def test_explicit_dtype_gives_torch_dtype():
    assert RunnerConfig(model="m", dtype="bf16", device="cpu").torch_dtype is torch.bfloat16


@pytest.mark.parametrize("avx512_bf16, amx, expected", [
    (False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)])
def test_auto_dtype_without_kernels_is_bfloat16_only_where_torch_has_it_native(no_cuda, monkeypatch, avx512_bf16,
                                                                              amx, expected):
    monkeypatch.delenv("RUNNER_CORE_CPU_BF16", raising=False)
    monkeypatch.setattr(kernels, "cpu_kernels_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    config = RunnerConfig(model="m")
    assert config.torch_device == torch.device("cpu")
    assert config.torch_dtype is expected
    assert auto_dtype("cpu", "bfloat16")[1].startswith("no native kernels" if expected is torch.float32
                                                       else "this CPU has native")


@pytest.mark.parametrize("tier, native, stored, expected, why", [
    ("avx512-bf16", True, "float32", "bfloat16", "the avx512-bf16 kernels multiply bfloat16 natively"),
    ("avx2", False, "bfloat16", "bfloat16", "the checkpoint is bfloat16 and the avx2 kernels read it as bfloat16"),
    ("plain", False, "bfloat16", "bfloat16", "the checkpoint is bfloat16 and the plain kernels read it"),
    ("avx2", False, "float32", "float32", "the avx2 kernels have no native bfloat16 products and the checkpoint "
                                          "is float32"),
    ("avx512", False, None, "float32", "the avx512 kernels have no native bfloat16 products")])
def test_auto_dtype_with_kernels_follows_their_tier_and_the_checkpoint(no_cuda, monkeypatch, tmp_path, tier, native,
                                                                       stored, expected, why):
    """A bfloat16 checkpoint stays bfloat16 on every tier (read as bf16, computed in float32 registers);
    float32 stays float32 unless the tier multiplies bfloat16 natively. torch's own check is not asked."""
    monkeypatch.delenv("RUNNER_CORE_CPU_BF16", raising=False)
    monkeypatch.setattr(kernels, "cpu_kernels_available", lambda: True)
    monkeypatch.setattr(kernels, "kernel_info", lambda: {"tier": tier, "native_bf16": native})
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: not native)  # must not decide
    if stored is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": stored}))
    config = RunnerConfig(model=str(tmp_path))
    assert config.torch_dtype is getattr(torch, expected)
    assert config.auto_dtype()[1].startswith(why), config.auto_dtype()


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_auto_dtype_on_each_kernel_tier_this_cpu_runs(no_cuda, monkeypatch, tmp_path, tier, stored):
    """The kernels themselves (not a stand-in) on each tier, on a CPU whose torch has no native bfloat16
    matmuls: a bfloat16 checkpoint stays bfloat16 on every tier and the reason names the tier; a float32
    one stays float32 unless the tier multiplies bfloat16 natively; with the kernels off both are float32."""
    monkeypatch.delenv("RUNNER_CORE_CPU_BF16", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": stored}))
    dtype, why = RunnerConfig(model=str(tmp_path)).auto_dtype()
    assert dtype == ("bfloat16" if stored == "bfloat16" or tier == "avx512-bf16" else "float32")
    assert why.startswith(f"the checkpoint is bfloat16 and the {tier} kernels read it as bfloat16"
                          if stored == "bfloat16" and tier != "avx512-bf16" else f"the {tier} kernels"), why
    with native_kernels_off():
        dtype, why = RunnerConfig(model=str(tmp_path)).auto_dtype()
    assert (dtype, why.split(",")[0]) == ("float32", "no native kernels")


def test_a_bad_bf16_override_is_refused_with_the_allowed_values(no_cuda, monkeypatch):
    monkeypatch.setenv("RUNNER_CORE_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match=r"RUNNER_CORE_CPU_BF16='yes'; allowed: '1' .* '0' .* or unset"):
        auto_dtype("cpu")


def test_auto_dtype_override_and_its_reason_in_model_info(no_cuda, monkeypatch, tiny_llama_path, caplog):
    monkeypatch.setenv("RUNNER_CORE_CPU_BF16", "1")
    with caplog.at_level(logging.INFO, logger="runner_core"):
        runner = ModelRunner(model=str(tiny_llama_path), kv_cache_memory=1 << 20, max_model_len=256).load_model()
    info = runner.model_info()
    assert (info["dtype"], info["dtype_reason"]) == ("bfloat16", "auto: RUNNER_CORE_CPU_BF16=1")
    assert "dtype auto -> bfloat16" in caplog.text
    assert next(runner.engine.worker.model.parameters()).dtype is torch.bfloat16
    runner.shutdown()


def test_device_falls_back_to_cpu_with_one_info_line(no_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="runner_core"):
        config = RunnerConfig(model="m", device=0)
    assert config.device == 0
    assert config.torch_device == torch.device("cpu")
    lines = [r for r in caplog.records if r.name == "runner_core"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "CUDA is not available" in lines[0].getMessage() and "CPU" in lines[0].getMessage()


@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_an_explicit_cuda_device_without_cuda_is_refused(no_cuda, device):
    """A CUDA device named explicitly is refused without CUDA (it used to run on the CPU with an info line);
    the default GPU index 0 still falls back (above)."""
    with pytest.raises(ConfigError) as info:
        RunnerConfig(model="m", device=device)
    message = str(info.value)
    assert f"'device' got {device!r}" in message and "no CUDA device" in message
    assert "device='cpu'" in message and "torch.cuda.is_available()" in message


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float16")])
def test_auto_dtype_on_cuda_is_bfloat16_where_the_gpu_has_it(two_gpus, monkeypatch, bf16, expected):
    """dtype auto on CUDA is bfloat16, as the simulator and the estimate take it (it was float16, which
    bf16-trained checkpoints can overflow); float16 only on a GPU without bfloat16."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    config = RunnerConfig(model="m", device="cuda")
    assert config.torch_dtype == getattr(torch, expected)
    assert ("no bfloat16" in config.auto_dtype()[1]) == (not bf16)


def test_auto_dtype_for_a_cuda_device_not_here_is_bfloat16(no_cuda):
    """The estimate of a CUDA device from a CPU machine takes bfloat16, as the simulator does."""
    assert auto_dtype("cuda") == ("bfloat16", auto_dtype("cuda")[1])


def test_cpu_device_logs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="runner_core"):
        assert RunnerConfig(model="m", device="cpu").torch_device == torch.device("cpu")
    assert not [r for r in caplog.records if r.name == "runner_core"]


@pytest.mark.parametrize("device, expected", [
    (0, torch.device("cuda", 0)), (1, torch.device("cuda", 1)),
    ("cuda:1", torch.device("cuda", 1)), ("cuda", torch.device("cuda", 1)),
    (torch.device("cuda", 0), torch.device("cuda", 0)),
])
def test_cuda_devices_resolve(two_gpus, device, expected):
    assert RunnerConfig(model="m", device=device).torch_device == expected


@pytest.mark.parametrize("device", [2, "cuda:5"])
def test_cuda_index_beyond_device_count(two_gpus, device):
    with pytest.raises(ConfigError) as info:
        RunnerConfig(model="m", device=device)
    assert "'device'" in str(info.value) and repr(device) in str(info.value)
    assert "a CUDA index below 2" in str(info.value)


def test_compile_backend_accepts_registered_dynamo_backends():
    import torch._dynamo

    for name in ["inductor", "aot_eager", "eager", *torch._dynamo.list_backends()]:
        assert RunnerConfig(model="m", compile_backend=name).compile_backend == name


def test_compile_cache_dir_accepts_a_path():
    assert RunnerConfig(model="m", compile_cache_dir=pathlib.Path("/tmp/cc")).compile_cache_dir == "/tmp/cc"


@given(st.integers(min_value=1, max_value=2**40))
def test_positive_ints_accepted(value):
    config = RunnerConfig(model="m", device="cpu", max_num_seqs=value, max_model_len=value)
    assert (config.max_num_seqs, config.max_model_len) == (value, value)


@given(st.integers(max_value=0))
def test_non_positive_ints_rejected(value):
    with pytest.raises(ConfigError, match="'max_num_seqs'"):
        RunnerConfig(model="m", device="cpu", max_num_seqs=value)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_gpu_memory_utilization_range(value):
    if 0 < value <= 1:
        assert RunnerConfig(model="m", device="cpu", gpu_memory_utilization=value).gpu_memory_utilization == value
    else:
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            RunnerConfig(model="m", device="cpu", gpu_memory_utilization=value)
