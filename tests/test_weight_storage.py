"""One copy of each weight: stored as its matmul reads it while the checkpoint streams in, counted to the
byte, quantized where asked (greedy tokens equal transformers on the same quantized weights), saved and
loaded again."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from runner_core import ModelLoadError, ModelRunner, SamplingParams
from runner_core.layers import weight_storage
from runner_core.layers.linear import LinearBase
from runner_core.layers.quantization import QuantFormat, dequantize, quantize
from tests.helpers import make_tiny_hf_model, native_kernels_off

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [200, 7, 7, 300, 41, 12, 9], [77]]


def _runner(path, **config) -> ModelRunner:
    return ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22, **config}).load_model()


def _tokens(runner) -> list[list[int]]:
    return [o.token_ids for o in runner.generate(PROMPTS, GREEDY)]


def _stored_layers(model):
    return [m for m in model.modules() if isinstance(m, weight_storage.WeightLayer) and m.multiplies]


def _holds_parameter(module) -> bool:
    return "weight" in dict(module.named_parameters(recurse=False))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tied"), "qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("untied"), "llama")


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_weight_is_held_once_and_counted_to_the_byte(untied, quantization, dtype):
    runner = _runner(untied, dtype=dtype, quantization=quantization)
    model, torch_dtype = runner.model, getattr(torch, dtype)
    layers = _stored_layers(model)
    assert layers and not any(map(_holds_parameter, layers))  # no row-major copy beside the stored one
    expected = sum(weight_storage.weight_bytes(*m.storage.shape, torch_dtype, m.storage.fmt, True) for m in layers)
    assert expected == sum(m.storage.nbytes for m in layers)
    assert weight_storage.stored_bytes(model) == expected
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert runner.memory_stats()["weights_bytes"] == expected + params == runner.model_info()["weights_bytes"]
    info = runner.model_info()["quantization"]
    assert info["format"] == quantization and info["weights_bytes"] == expected + params
    assert runner.model_info()["num_parameters"] == sum(p.numel() for p in
                                                        transformers.AutoModelForCausalLM.from_pretrained(untied)
                                                        .parameters())
    if quantization:  # the head stays in the compute dtype by default, and says so
        assert info["kept_layers"] == {"lm_head": "the LM head (quantize_lm_head=False)"}
        assert info["weights_bytes"] < info["dense_bytes"]
    runner.shutdown()


def test_layers_are_stored_as_the_checkpoint_streams_in(untied, monkeypatch):
    """Each layer is stored as soon as its last shard is in: whenever one is stored, at most one other layer
    holds a loaded row-major weight (a fused qkv whose k and q shards come before and after o_proj in the
    checkpoint's sorted order), so the model is never held twice (nor, quantized, in full precision)."""
    from runner_core.loader.model_loader import ModelLoader

    built, others_waiting = [], []
    build, store = ModelLoader._build, LinearBase.store_weight

    def counting_store(module, source=None):
        others_waiting.append(sum(1 for m in _stored_layers(built[0]) if m is not module
                                  and _holds_parameter(m) and m.shards_loaded))
        store(module, source)

    monkeypatch.setattr(ModelLoader, "_build", lambda self, *a: built.append(build(self, *a)) or built[-1])
    monkeypatch.setattr(LinearBase, "store_weight", counting_store)
    runner = _runner(untied, quantization="int8")
    assert len(others_waiting) == 2 * 4 and max(others_waiting) == 1  # 2 layers x (qkv, o, gate_up, down)
    runner.shutdown()


def _quantized_reference(path, fmt: QuantFormat, head: bool):
    """transformers' model with every linear weight (and the head, if `head`) replaced by its quantized values."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and (head or name != "lm_head"):
                module.weight.copy_(dequantize(quantize(module.weight, fmt), fmt))
    return hf


def _hf_tokens(hf) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_tied_quantized_head_gives_transformers_tokens_and_embeds_from_its_one_copy(tied, quantization):
    fmt = QuantFormat.of(quantization, 32)
    runner = _runner(tied, quantization=quantization, quantization_group_size=32, quantize_lm_head=True)
    embed = runner.model.model.embed_tokens
    assert not _holds_parameter(embed) and embed.storage is runner.model.lm_head.storage
    # the one copy is reached under the head's name alone, as an exported (compiled) program must see it
    stored = [name for name, _ in runner.model.named_modules(remove_duplicate=False) if name.endswith(".storage")
              and name.startswith(("model.embed_tokens", "lm_head"))]
    assert stored == ["lm_head.storage"]
    assert runner.model_info()["quantization"]["kept_layers"] == {}
    assert _tokens(runner) == _hf_tokens(_quantized_reference(tied, fmt, head=True))
    runner.shutdown()


def test_without_the_kernels_quantized_rows_give_the_same_tokens(untied):
    """Where the native kernels are off (several processes, CUDA, RUNNER_CORE_NO_KERNELS), int4 is kept
    row-major and dequantized a layer at a time: the same greedy tokens."""
    panels = _runner(untied, quantization="int4")
    expected = _tokens(panels)
    panels.shutdown()
    with native_kernels_off():
        rows = _runner(untied, quantization="int4")
        assert {m.storage.kind for m in _stored_layers(rows.model)} == {"quant-rows", None}
        assert _tokens(rows) == expected
        rows.shutdown()


@pytest.mark.parametrize("config", [dict(quantization="int4", quantization_group_size=32, quantize_lm_head=True),
                                    dict(quantization="int8"), dict(dtype="bfloat16")])
def test_a_saved_model_loads_again_as_it_was_stored(tied, tmp_path, config):
    runner = _runner(tied, **config)
    expected, info = _tokens(runner), runner.model_info()["quantization"]
    before = {n: t.clone() for n, t in runner.model.named_buffers() if n.endswith((".qpanels", ".panels"))}
    out = runner.save_pretrained(tmp_path / "saved")
    runner.shutdown()
    saved = json.loads((out / "config.json").read_text())
    assert saved.get("quantization_config", {}).get("format") == config.get("quantization")
    again = _runner(out, dtype=config.get("dtype", "float32"))
    assert again.model_info()["quantization"] == {**info, "kept_layers": info["kept_layers"]}
    after = dict(again.model.named_buffers())
    assert all(torch.equal(after[n], t) for n, t in before.items())  # the same integers (or panels), not re-rounded
    assert _tokens(again) == expected
    again.shutdown()


def test_formats_that_cannot_apply_are_refused_with_the_fix(untied, tmp_path):
    runner = _runner(untied, quantization="int8")
    out = runner.save_pretrained(tmp_path / "int8")
    runner.shutdown()
    with pytest.raises(ModelLoadError, match="stored in int8, but quantization='int4' was asked"):
        _runner(out, quantization="int4")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized with 'gptq'.*out of scope"):
        _runner(out)
    with pytest.raises(ModelLoadError, match="needs a native adapter"):
        _runner(untied, quantization="int8", model_impl="transformers")


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_are_made_and_held_on_the_models_device(device, quantization):
    """A model built on a device (CUDA; here "meta", which no CPU tensor can pass for) gets its int8/int4
    weights there, whether one checkpoint tensor is the whole weight or fused shards are staged: they were
    quantized and registered on the CPU, and the first forward on CUDA met a device mismatch (issue 39)."""
    from runner_core.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear

    with torch.device(device):
        model = torch.nn.ModuleDict({"one": ColumnParallelLinear(64, 32),
                                     "fused": MergedColumnParallelLinear(64, [16, 16])})
    weight_storage.plan_storage(model, torch.float32, False, QuantFormat.of(quantization, 32), False)
    assert model["fused"].weight.device.type == device  # the float32 staging of the fused shards
    model["one"].load_shard(model["one"].weight, torch.randn(32, 64))
    for shard in (0, 1):
        model["fused"].load_shard(model["fused"].weight, torch.randn(16, 64), shard)
    for layer in model.values():
        assert layer.storage.stored and layer.storage.kind == "quant-rows"
        assert {t.device.type for t in layer.storage.buffers()} == {device}


def test_int4_layers_take_the_largest_group_that_divides_k():
    assert weight_storage.layer_format(QuantFormat.of("int4", 128), 352) == QuantFormat.of("int4", 32)
    assert weight_storage.layer_format(QuantFormat.of("int4", 64), 896) == QuantFormat.of("int4", 64)
    assert weight_storage.layer_format(QuantFormat.of("int4", 32), 100) is None
    assert weight_storage.layer_format(QuantFormat.of("int8"), 100) == QuantFormat.of("int8")


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_routers_keep_the_compute_dtype_and_the_estimate_follows(preset):
    from runner_core import estimate_memory

    runner = _runner(preset, quantization="int8", max_model_len=256)
    info = runner.model_info()["quantization"]
    routers = [name for name in info["kept_layers"] if name.endswith(("mlp.gate", "shared_expert_gate"))]
    assert routers and all(info["kept_layers"][name].startswith("an MoE router") for name in routers)
    est = estimate_memory(preset, dtype="float32", quantization="int8", max_model_len=256)
    assert est.weights_bytes == runner.memory_stats()["weights_bytes"]
    runner.shutdown()
