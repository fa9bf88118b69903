"""Memory prediction (runner_core.memory: estimate, shapes, fit) against measurement, parallel and dtype
scaling, refusal of configurations that cannot fit, and the pool plan (sizing)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from runner_core import ConfigError, ModelRunner, RunnerConfig
from runner_core.loader.model_loader import read_hf_config, resolve_model_path
from runner_core.memory import ModelShape, kv_bytes_per_token
from runner_core.memory.estimate import estimate_memory
from runner_core.memory.fit import check_config_fits, check_fits, required_bytes
from runner_core.memory.profile import dummy_batch
from runner_core.memory.sizing import CPU_KV_CAP_BYTES, CPU_KV_FRACTION, plan_kv_pool, plan_pool

MAX_LEN, TOKENS = 512, 512
KV_MEMORY = 8 << 20


def _unique_param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


@pytest.fixture(scope="module", params=["tiny-llama", "small-llama"])
def loaded(request):
    name = request.param
    runner = ModelRunner({"model": name, "dtype": "float32", "kv_cache_memory": KV_MEMORY, "max_model_len": MAX_LEN,
                          "max_num_seqs": 8, "max_num_batched_tokens": TOKENS}).load_model()
    yield name, runner
    runner.shutdown()


def test_prediction_matches_measurement(loaded):
    name, runner = loaded
    est = estimate_memory(name, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8,
                          max_num_batched_tokens=TOKENS, kv_cache_memory=KV_MEMORY)
    # weights and pool to the byte (headers and shapes give both exactly); the activation peak within 0.1%
    # (measured: the estimate 28 bytes above, on both presets, in float32 and bfloat16)
    assert est.weights_bytes == runner.memory_stats()["weights_bytes"]  # one copy: the panels only
    assert est.dense_weights_bytes == _unique_param_bytes(_dense_model(name)) <= est.weights_bytes
    kv = runner.engine.memory.kv_cache
    assert est.kv_pool_bytes == kv.numel() * kv.element_size()
    measured = runner.engine.worker.measure_activation_peak(TOKENS, 8)
    assert abs(est.activation_peak_bytes - measured) <= 0.001 * measured, (est.activation_peak_bytes, measured)
    assert est.total_per_device_bytes == (est.weights_bytes + est.kv_pool_bytes + est.activation_peak_bytes
                                          + est.buffers_bytes)


def _dense_model(name: str) -> torch.nn.Module:
    """The preset as transformers builds it (every weight a float32 parameter), on the meta device."""
    from transformers import AutoModelForCausalLM

    from runner_core.loader.model_loader import resolve_model_path

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(read_hf_config(resolve_model_path(name)))


@pytest.mark.parametrize("quantization, group, lm_head", [("int8", 64, False), ("int4", 64, False),
                                                           ("int4", 128, True)])
@pytest.mark.parametrize("name", ["tiny-llama", "small-llama", "tiny-speaker"])
def test_stored_weights_predicted_to_the_byte(name, quantization, group, lm_head):
    """int8 / int4 storage: the estimate's weights are what the loaded runner holds, to the byte (panels
    of the stored format where the kernels run, the LM head in the compute dtype unless quantized too; a
    tied embedding reading its rows from the head; tiny-speaker's k=352 taking int4 groups of 32), and
    its dense figure is model_info's."""
    settings = {"quantization": quantization, "quantization_group_size": group, "quantize_lm_head": lm_head}
    runner = ModelRunner({"model": name, "dtype": "float32", "kv_cache_memory": 1 << 20, "max_model_len": 64,
                          "max_num_seqs": 2, **settings}).load_model()
    try:
        est = estimate_memory(name, dtype="float32", max_model_len=64, max_num_seqs=2, **settings)
        info = runner.model_info()["quantization"]
        assert est.weights_bytes == runner.memory_stats()["weights_bytes"] == info["weights_bytes"]
        assert est.dense_weights_bytes == info["dense_bytes"] > est.weights_bytes
        assert re.search(rf"weights +{est.weights_bytes / 2**20:.1f}  {quantization}", str(est))
    finally:
        runner.shutdown()


def test_bfloat16_weights_predicted_to_the_byte(tiny_llama_path):
    """bfloat16 runners hold their linear weights as panels only wherever the native kernels run (every tier
    multiplies bfloat16 panels), row-major with them off; the estimate says which, to the byte."""
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "bfloat16", "max_model_len": 64,
                          "max_num_seqs": 2}).load_model()
    try:
        est = estimate_memory(tiny_llama_path, dtype="bfloat16", max_model_len=64, max_num_seqs=2)
        assert est.weights_bytes == runner.memory_stats()["weights_bytes"]
        assert est.dense_weights_bytes <= est.weights_bytes
    finally:
        runner.shutdown()


def test_pool_without_kv_cache_memory_is_max_num_seqs_sequences(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "max_model_len": 100,
                          "max_num_seqs": 3}).load_model()
    est = estimate_memory(tiny_llama_path, dtype="float32", max_model_len=100, max_num_seqs=3)
    kv = runner.engine.memory.kv_cache
    assert est.kv_pool_tokens == 304  # 3 x 100 rounded up to 16-token blocks
    assert est.kv_pool_bytes == kv.numel() * kv.element_size()
    shape, model = ModelShape.from_hf_config(runner.engine.hf_config), runner.model
    bytes_per_token = kv_bytes_per_token(shape.num_layers, model.num_kv_heads, model.head_dim, torch.float32)
    plan = plan_kv_pool(runner.config, shape, 100, bytes_per_token=bytes_per_token, weights_bytes=0,
                        attention_backend=runner.engine.worker.forward_pass.attention_backend)
    assert plan.num_tokens == 304 and plan.num_bytes == est.kv_pool_bytes
    runner.shutdown()


def test_profile_grows_linearly_with_tokens(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": KV_MEMORY,
                          "max_model_len": MAX_LEN}).load_model()
    small, large = (runner.engine.worker.measure_activation_peak(n, 4) for n in (128, 512))
    assert 0.9 * 4 < large / small < 1.1 * 4
    assert 1 << 20 < large < 16 << 20  # a few MB for 512 tokens of tiny-llama


def test_dummy_batch_layout():
    seqs = dummy_batch(10, 4)
    assert [len(s) for s in seqs] == [7, 1, 1, 1]
    assert [len(s) for s in dummy_batch(3, 8)] == [1, 1, 1]


def _build_sharded(hf_config, tp: int, monkeypatch) -> torch.nn.Module:
    """The runner's model as rank 0 of `tp` ranks would build it, on the meta device."""
    from runner_core.layers import embedding, linear
    from runner_core.models.llama import LlamaForCausalLM

    for module in (linear, embedding):
        monkeypatch.setattr(module, "get_tp_size", lambda: tp)
        monkeypatch.setattr(module, "get_tp_rank", lambda: 0)
    with torch.device("meta"):
        return LlamaForCausalLM(hf_config)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_per_device(tiny_llama_path, tp, monkeypatch):
    one = estimate_memory(tiny_llama_path, dtype="float32", tensor_parallel_size=1, max_model_len=256)
    est = estimate_memory(tiny_llama_path, dtype="float32", tensor_parallel_size=tp, max_model_len=256)
    cfg = read_hf_config(tiny_llama_path)
    model = _build_sharded(cfg, tp, monkeypatch)
    assert est.weights_bytes == _unique_param_bytes(model)
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    replicated = (2 * layers + 1) * h * 4  # the norms
    kv_proj = layers * 2 * (cfg.num_key_value_heads * cfg.head_dim) * h * 4
    if tp <= cfg.num_key_value_heads:
        assert est.weights_bytes == (one.weights_bytes - replicated) // tp + replicated
    else:  # 2 KV heads over 4 ranks: each holds one KV head, i.e. half of k/v instead of a quarter
        assert est.weights_bytes == (one.weights_bytes - replicated - kv_proj) // tp + replicated + kv_proj // 2
    # KV heads per device: 2 / tp, but at least one (replicated when tp > kv heads)
    assert est.kv_bytes_per_token == one.kv_bytes_per_token // min(tp, cfg.num_key_value_heads)
    assert est.num_devices == tp and est.activation_peak_bytes < one.activation_peak_bytes


def test_pipeline_parallel_per_device(tiny_llama_path):
    one = estimate_memory(tiny_llama_path, dtype="float32", max_model_len=256)
    est = estimate_memory(tiny_llama_path, dtype="float32", pipeline_parallel_size=2, max_model_len=256)
    cfg = read_hf_config(tiny_llama_path)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    layer = (one.weights_bytes - 2 * embed - cfg.hidden_size * 4) // cfg.num_hidden_layers
    # stage 0: embedding + 2 layers; stage 1: 2 layers + final norm + LM head
    assert est.weights_bytes == embed + 2 * layer + cfg.hidden_size * 4
    assert est.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert est.kv_pool_tokens == one.kv_pool_tokens and est.num_devices == 2
    tp_pp = estimate_memory(tiny_llama_path, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2,
                            max_model_len=256)
    assert tp_pp.num_devices == 4 and tp_pp.weights_bytes < est.weights_bytes


def test_pipeline_stage_layers_are_honoured(tiny_llama_path):
    """A configured uneven split puts 3 layers (and the embedding) on stage 0: the per-device maximum is
    that stage's weights and its 3 layers' KV, not the even split's 2."""
    even = estimate_memory(tiny_llama_path, dtype="float32", pipeline_parallel_size=2, max_model_len=256)
    split = estimate_memory(tiny_llama_path, dtype="float32", pipeline_parallel_size=2, pipeline_stage_layers=[3, 1],
                            max_model_len=256)
    one = estimate_memory(tiny_llama_path, dtype="float32", max_model_len=256)
    cfg = read_hf_config(tiny_llama_path)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    layer = (one.weights_bytes - 2 * embed - cfg.hidden_size * 4) // cfg.num_hidden_layers
    assert split.weights_bytes == embed + 3 * layer  # stage 1: one layer + norm + LM head is smaller
    assert split.kv_bytes_per_token == one.kv_bytes_per_token * 3 // 4 > even.kv_bytes_per_token
    assert split.total_per_device_bytes > even.total_per_device_bytes
    with pytest.raises(ConfigError, match=r"pipeline_stage_layers=\[2, 1\] adds up to 3 layers but the model has 4"):
        estimate_memory(tiny_llama_path, pipeline_parallel_size=2, pipeline_stage_layers=[2, 1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_halves_weights_and_kv(tiny_llama_path, dtype):
    full = estimate_memory(tiny_llama_path, dtype="float32", max_model_len=256, max_num_seqs=4)
    half = estimate_memory(tiny_llama_path, dtype=dtype, max_model_len=256, max_num_seqs=4)
    assert half.weights_bytes * 2 == full.weights_bytes
    assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token
    assert half.kv_pool_bytes * 2 == full.kv_pool_bytes
    assert half.dtype == dtype and half.activation_peak_bytes < full.activation_peak_bytes


def test_auto_dtype_follows_the_device(tiny_llama_path):
    assert estimate_memory(tiny_llama_path, device="cpu").dtype == "float32"
    assert estimate_memory(tiny_llama_path, device="cuda").dtype == "bfloat16"


def test_config_only_estimate_equals_header_estimate(tiny_llama_path, tmp_path):
    shutil.copy(tiny_llama_path / "config.json", tmp_path / "config.json")
    from_config = estimate_memory(tmp_path, dtype="float32", max_model_len=256)
    from_headers = estimate_memory(tiny_llama_path, dtype="float32", max_model_len=256)
    assert from_config.weights_bytes == from_headers.weights_bytes
    assert from_config.as_dict() | {"model": ""} == from_headers.as_dict() | {"model": ""}


def test_str_and_as_dict(tiny_llama_path):
    est = estimate_memory(tiny_llama_path, dtype="float32", max_model_len=256, kv_cache_memory=1 << 20)
    text = str(est)
    for word in ("weights", "KV pool", "activation peak", "total", "MiB"):
        assert word in text
    d = est.as_dict()
    assert d["kv_pool_bytes"] == 1 << 20 and d["max_model_len"] == 256 and "inputs" not in d


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_path):
    with pytest.raises(ConfigError, match="max_position_embeddings=2048"):
        estimate_memory(tiny_llama_path, max_model_len=4096)


def test_configuration_that_cannot_fit_is_refused():
    est = estimate_memory("small-llama", dtype="float32", max_model_len=4096)
    available = 150 << 20
    assert required_bytes(est) > available
    with pytest.raises(ConfigError) as info:
        check_fits(est, available, gpu_memory_utilization=0.9)
    msg = str(info.value)
    assert "needs" in msg and f"available: {available / 2**20:.1f} MiB" in msg and "weights 120.5 MiB" in msg
    assert "dtype='bfloat16'" in msg and "fits" in msg
    assert "tensor_parallel_size=2" in msg
    assert "max_model_len=" in msg
    tip = int(msg.split("max_model_len=")[-1].split(" ")[0])
    assert required_bytes(estimate_memory("small-llama", dtype="float32", max_model_len=tip)) <= available
    assert required_bytes(estimate_memory("small-llama", dtype="float32", max_model_len=tip + 1)) > available
    check_fits(est, required_bytes(est), gpu_memory_utilization=0.9)  # exactly enough passes


def test_too_large_kv_cache_memory_is_refused_with_a_smaller_one_suggested():
    est = estimate_memory("tiny-llama", dtype="float32", max_model_len=256, kv_cache_memory=1 << 30)
    with pytest.raises(ConfigError, match=r"kv_cache_memory=\d+ \([\d.]+ MiB\) or less"):
        check_fits(est, 64 << 20)


def test_check_config_fits_uses_the_runner_config():
    config = RunnerConfig(model="tiny-llama", dtype="float32", device="cpu", max_model_len=256)
    assert check_config_fits(config, available_bytes=1 << 30).max_model_len == 256
    with pytest.raises(ConfigError, match="does not fit"):
        check_config_fits(config, available_bytes=1 << 20)


def test_plan_pool_cuda_budget():
    block_bytes = 1 << 16
    plan = plan_pool(bytes_per_token=block_bytes // 16, block_size=16, max_model_len=1024, max_num_seqs=4,
                     kv_cache_memory=None, device="cuda", gpu_memory_utilization=0.9, weights_bytes=1 << 30,
                     activation_peak_bytes=512 << 20, total_bytes=10 << 30, non_torch_bytes=512 << 20)
    budget = int((10 << 30) * 0.9) - (1 << 30) - (1 << 30)
    assert plan.source == "gpu_memory_utilization" and plan.num_blocks == budget // block_bytes
    assert plan.max_concurrency == plan.num_tokens / 1024
    line = plan.describe()
    assert f"{plan.num_blocks} blocks" in line and f"{plan.num_tokens} tokens" in line and "concurrency" in line
    graphs = plan_pool(bytes_per_token=block_bytes // 16, block_size=16, max_model_len=1024, max_num_seqs=4,
                       kv_cache_memory=None, device="cuda", gpu_memory_utilization=0.9, weights_bytes=1 << 30,
                       activation_peak_bytes=512 << 20, total_bytes=10 << 30, non_torch_bytes=512 << 20,
                       reserved_bytes=256 << 20)
    assert graphs.num_blocks == (budget - (256 << 20)) // block_bytes  # room left for the decode CUDA graphs


def test_cuda_pool_is_sized_for_the_attention_backend_that_runs(monkeypatch):
    """Flex (CUDA's default) reads the pool in place: no decode gathers every context. Sized as if it did,
    Llama-3.1-8B at its 131,072 positions on an 80 GiB device planned 0 blocks (a ConfigError at load)."""
    from types import SimpleNamespace

    shape = ModelShape.from_hf_config(read_hf_config(resolve_model_path("llama-3.1-8b", weights=False)))
    config = SimpleNamespace(torch_device=torch.device("cuda"), torch_dtype=torch.bfloat16, block_size=16,
                             effective_max_num_batched_tokens=2048, max_num_seqs=256, tensor_parallel_size=1,
                             kv_cache_memory=None, gpu_memory_utilization=0.9)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    bpt = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.bfloat16)
    plans = {backend: plan_kv_pool(config, shape, 131072, bytes_per_token=bpt, weights_bytes=16 << 30,
                                   attention_backend=backend) for backend in ("flex", "gather")}
    assert plans["gather"].activation_peak_bytes > 100 << 30 and plans["gather"].num_blocks == 0
    assert plans["flex"].activation_peak_bytes < 2 << 30
    assert plans["flex"].num_tokens > 131072 * 3  # 55+ GiB of pool: several full-length sequences
    # the estimate before loading takes the backend CUDA runs ("auto": flex), unless gather is chosen
    est = {b: estimate_memory("llama-3.1-8b", dtype="bfloat16", device="cuda", attention_backend=b)
           for b in ("auto", "gather")}
    est = {b: e.activation_peak_bytes for b, e in est.items()}
    assert est["auto"] < 2 << 30 < 100 << 30 < est["gather"]


def test_plan_pool_cpu_and_override():
    kw = dict(bytes_per_token=1024, block_size=16, max_model_len=1000, device="cpu", gpu_memory_utilization=0.9)
    capped = plan_pool(max_num_seqs=2, kv_cache_memory=None, available_bytes=1 << 40, **kw)
    assert capped.num_tokens == 2000 and capped.source == "cpu_ram"  # what 2 sequences can use
    ram = plan_pool(max_num_seqs=10**6, kv_cache_memory=None, available_bytes=1 << 30, **kw)
    assert ram.num_bytes == int((1 << 30) * CPU_KV_FRACTION) // (1024 * 16) * 1024 * 16
    big = plan_pool(max_num_seqs=10**6, kv_cache_memory=None, available_bytes=1 << 40, **kw)
    assert big.num_bytes == CPU_KV_CAP_BYTES
    fixed = plan_pool(max_num_seqs=2, kv_cache_memory=1 << 20, available_bytes=1 << 40, **kw)
    assert fixed.source == "kv_cache_memory" and fixed.num_bytes == 1 << 20
    cuda_fixed = plan_pool(max_num_seqs=2, kv_cache_memory=1 << 20, **{**kw, "device": "cuda"})
    assert cuda_fixed.num_bytes == 1 << 20  # overrides everywhere, without asking the device
