"""ModelLoader, registry, presets and tokenizer: loading from disk and every refusal path."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers import make_tiny_hf_model
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from runner_core.config import RunnerConfig
from runner_core.errors import InvalidRequestError, ModelLoadError
from runner_core.loader.model_loader import ModelLoader, resolve_model_path
from runner_core.loader.tokenizer import ByteTokenizer, IncrementalDetokenizer, load_tokenizer
from runner_core.models import MODEL_REGISTRY, ModelAdapterRegistry, presets

STAND_IN_ARCH = "RunnerTestStandInForCausalLM"


class StandInForCausalLM(transformers.LlamaForCausalLM):
    """Stand-in for the runner's Llama: HF names and shapes, weights copied by name (loaded, never run)."""

    num_layers, num_kv_heads, head_dim, sliding_window = 2, 2, 16, None  # what the model contract asks

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match expected {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        return loaded


@pytest.fixture
def stand_in():
    MODEL_REGISTRY.register(STAND_IN_ARCH, StandInForCausalLM)
    yield
    MODEL_REGISTRY._targets.pop(STAND_IN_ARCH)


def stand_in_model(tmp_path: Path) -> Path:
    path = make_tiny_hf_model(tmp_path)
    edit_config(path, architectures=[STAND_IN_ARCH])
    return path


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def runner_config(model, **overrides) -> RunnerConfig:
    return RunnerConfig({"model": str(model), "dtype": "float32", "device": "cpu", **overrides})


def assert_same_weights(model: torch.nn.Module, path: Path) -> None:
    expected = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, expected[name].to(param.dtype), rtol=0, atol=0)


# --- loading --------------------------------------------------------------------------------


def test_single_file(tmp_path, stand_in):
    path = stand_in_model(tmp_path)
    loaded = ModelLoader(runner_config(path)).load()
    assert loaded.model_path == path and not loaded.model.training
    assert loaded.hf_config.architectures == [STAND_IN_ARCH]
    assert loaded.weight_bytes == sum(p.numel() * 4 for p in loaded.model.parameters())
    assert loaded.tokenizer.hf is None  # no tokenizer files: byte-level fallback
    assert loaded.load_seconds > 0
    assert_same_weights(loaded.model, path)


def test_target_dtype_and_default_dtype_restored(tmp_path, stand_in):
    loaded = ModelLoader(runner_config(stand_in_model(tmp_path), dtype="bfloat16")).load()
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_sharded_with_index(tmp_path, stand_in):
    source = stand_in_model(tmp_path)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="200KB")
    edit_config(sharded, architectures=[STAND_IN_ARCH])
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    loaded = ModelLoader(runner_config(sharded)).load()
    assert_same_weights(loaded.model, source)


def test_missing_directory():
    with pytest.raises(ModelLoadError, match=r"unknown model './no/such/model' \(no such directory\): pass a "
                                             "directory holding config.json, a preset .*tiny-llama"):
        resolve_model_path("./no/such/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelLoader(runner_config(tmp_path)).load()


def test_no_weights_and_pickle_refused(tmp_path, stand_in):
    path = stand_in_model(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no safetensors weights \(\*\.safetensors\)"):
        ModelLoader(runner_config(path)).load()
    (path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match="refused for safety.*safe_serialization=True"):
        ModelLoader(runner_config(path)).load()


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors(tmp_path, stand_in, damage):
    path = stand_in_model(tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 16 + data[16:])
    with pytest.raises(ModelLoadError, match=f"{file}.*corrupt or truncated"):
        ModelLoader(runner_config(path)).load()


def test_shape_mismatch_names_tensor_shapes_and_file(tmp_path, stand_in):
    path = stand_in_model(tmp_path)
    edit_config(path, intermediate_size=96)  # the checkpoint has 128
    with pytest.raises(ModelLoadError) as err:
        ModelLoader(runner_config(path)).load()
    message = str(err.value)
    assert re.search(r"'model\.layers\.0\.mlp\.\w+\.weight'", message)
    assert re.search(r"\((64, 128|128, 64)\)", message) and re.search(r"\((64, 96|96, 64)\)", message)
    assert str(path / "model.safetensors") in message


def test_missing_parameters_listed(tmp_path, stand_in):
    path = stand_in_model(tmp_path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["lm_head.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="1 parameters .* not in the checkpoint .*: lm_head.weight"):
        ModelLoader(runner_config(path)).load()


def test_per_layer_sliding_windows_are_refused(tmp_path):
    """Qwen2 with a sliding window above max_window_layers only: one window per step cannot express it."""
    path = make_tiny_hf_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ModelLoadError, match=r"cannot build LlamaForCausalLM .*layer_types mixes full_attention, "
                                             r"sliding_attention .*use_sliding_window=false"):
        ModelLoader(runner_config(path)).load()


def test_unsupported_architecture_lists_supported(tmp_path):
    path = make_tiny_hf_model(tmp_path)
    edit_config(path, architectures=["FooForCausalLM"])
    with pytest.raises(ModelLoadError) as err:
        ModelLoader(runner_config(path)).load()
    assert "architecture 'FooForCausalLM' is neither registered natively nor a causal LM of transformers" \
        in str(err.value)
    native = str(err.value).split("(native: ")[1]
    assert all(name in native for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                           "Qwen3ForCausalLM", "LlavaForConditionalGeneration",
                                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"))


def test_registry_lazy_targets_and_model_type_fallback():
    registry = ModelAdapterRegistry()
    registry.register("LlamaForCausalLM", "collections:OrderedDict")
    registry.register("Broken", "no_such_module_xyz:Model")
    from collections import OrderedDict

    def model_class(hf_config, impl="auto"):
        return registry.get_adapter(hf_config, impl).model_class

    assert model_class(SimpleNamespace(architectures=None, model_type="llama")) is OrderedDict
    adapter = registry.get_adapter(SimpleNamespace(architectures=["Other", "LlamaForCausalLM"]))
    assert (adapter.model_class, adapter.architecture, adapter.impl, adapter.kind) == (
        OrderedDict, "LlamaForCausalLM", "native", "causal_lm")
    with pytest.raises(ModelLoadError, match="cannot import no_such_module_xyz:Model"):
        model_class(SimpleNamespace(architectures=["Broken"]))
    with pytest.raises(ModelLoadError, match="'model_type=no_such_type' is neither registered natively nor a causal "
                                             r"LM of transformers .*\(native: Broken, Llama"):
        model_class(SimpleNamespace(architectures=[], model_type="no_such_type"))
    with pytest.raises(ModelLoadError, match="'Other' has no native adapter .*use model_impl='auto' or 'transformers'"):
        model_class(SimpleNamespace(architectures=["Other"]), "native")
    with pytest.raises(ValueError, match="kind 'vision' .* not one of causal_lm, moe, multimodal"):
        registry.register("X", "m:C", kind="vision")


def test_hub_id_offline_is_refused_with_advice(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="unknown model 'some-org/some-model' .*tiny-llama, small-llama.*nor a "
                                             "hub id in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        resolve_model_path("some-org/some-model")
    # A snapshot already in the HF cache is used as is.
    snapshot = tmp_path / "models--some-org--some-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    assert resolve_model_path("some-org/some-model") == snapshot


# --- presets ----------------------------------------------------------------------------------


def test_preset_resolves(tiny_llama_path):
    assert resolve_model_path("tiny-llama") == tiny_llama_path
    config = json.loads((tiny_llama_path / "config.json").read_text())
    assert (config["vocab_size"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (512, 2, False)


def test_presets_build_deterministically(tmp_path, monkeypatch):
    builds = []
    for name in ("a", "b"):
        monkeypatch.setenv("RUNNER_WORKBENCH_CACHE", str(tmp_path / name))
        builds.append(presets.ensure_preset("tiny-llama"))
    assert builds[0].name == builds[1].name and builds[0] != builds[1]
    files = sorted(p.name for p in builds[0].iterdir())
    assert files == sorted(p.name for p in builds[1].iterdir())
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    for name in files:
        assert (builds[0] / name).read_bytes() == (builds[1] / name).read_bytes(), name
    assert [p.name for p in (tmp_path / "a" / "presets").iterdir()] == [builds[0].name]  # no temp left


def test_preset_build_that_loses_the_race_uses_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_WORKBENCH_CACHE", str(tmp_path))
    final = presets.preset_dir("tiny-llama")

    def build_while_another_process_finishes(spec, out, name):
        final.mkdir(parents=True)
        (final / "winner").write_text("")
        (out / "loser").write_text("")

    monkeypatch.setattr(presets, "build_preset", build_while_another_process_finishes)
    assert presets.ensure_preset("tiny-llama") == final
    assert [p.name for p in final.iterdir()] == ["winner"]
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_unknown_preset():
    with pytest.raises(ModelLoadError, match="unknown preset 'huge-llama'; presets: tiny-llama, small-llama"):
        presets.ensure_preset("huge-llama")


# --- tokenizer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preset_tokenizer(tiny_llama_path):
    return load_tokenizer(tiny_llama_path, transformers.AutoConfig.from_pretrained(tiny_llama_path))


def test_preset_tokenizer_ids(preset_tokenizer):
    assert preset_tokenizer.hf is not None and preset_tokenizer.vocab_size == 512
    assert (preset_tokenizer.pad_token_id, preset_tokenizer.bos_token_id) == (0, 1)
    assert preset_tokenizer.eos_token_ids == frozenset({2})
    assert preset_tokenizer.encode("hello")[0] == 1


@settings(max_examples=200, deadline=None)
@given(text=st.text().filter(lambda t: not any(s in t for s in presets.SPECIAL_TOKENS)))
def test_preset_tokenizer_round_trip(preset_tokenizer, text):
    assert preset_tokenizer.decode(preset_tokenizer.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_byte_fallback_round_trip(text):
    tokenizer = ByteTokenizer(512)
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and max(ids, default=0) < 259
    assert tokenizer.decode(ids) == text


def test_byte_fallback_loaded_for_directory_without_tokenizer(tmp_path):
    path = make_tiny_hf_model(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    config = transformers.AutoConfig.from_pretrained(path)
    config.eos_token_id = 7
    tokenizer = load_tokenizer(path, config)
    assert tokenizer.hf is None and tokenizer.vocab_size == 259
    assert tokenizer.eos_token_ids == frozenset({2, 7, 9})
    assert tokenizer.encode("é") == [1, 0xC3 + 3, 0xA9 + 3]
    assert tokenizer.decode([1, 0xC3 + 3, 0xA9 + 3, 300, 2]) == "é<300>"
    assert tokenizer.decode([1, 3 + ord("a"), 2], skip_special_tokens=False) == "<s>a</s>"


def test_byte_fallback_with_small_vocab_refuses_text():
    tokenizer = ByteTokenizer(100)
    with pytest.raises(InvalidRequestError, match="no tokenizer.*too small.*pass token ids"):
        tokenizer.encode("hi")
    assert tokenizer.decode([5, 17]) == "<5><17>"


def test_explicit_tokenizer_path_without_files(tmp_path, stand_in):
    path = stand_in_model(tmp_path)
    with pytest.raises(ModelLoadError, match="holds no tokenizer files"):
        ModelLoader(runner_config(path, tokenizer=str(path))).load()


def test_incremental_detokenizer_holds_split_characters():
    from runner_core.loader.tokenizer import Tokenizer

    tokenizer = Tokenizer(ByteTokenizer(512))
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    deltas = [detok.add([b + 3]) for b in "a中b".encode()]
    assert deltas == ["a", "", "", "中", "b"]
    assert detok.text == "a中b"


def test_incremental_detokenizer_matches_full_decode(preset_tokenizer):
    prompt = preset_tokenizer.encode("Say:")
    ids = preset_tokenizer.encode(" naïve 🎉 世界, done")[1:]
    detok = IncrementalDetokenizer(preset_tokenizer, prompt)
    deltas = [detok.add([i]) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == preset_tokenizer.decode(ids)
    assert "" in deltas  # the emoji's bytes arrived over several tokens


def test_a_mapped_checkpoint_tensor_paged_out_reads_the_same(tmp_path):
    """A checkpoint tensor safetensors maps is seen as on a file mapping (an ordinary tensor is not); paging its
    pages out (what a load does chunk by chunk once it has read them) loses nothing: it reads the same after."""
    from safetensors import safe_open

    from runner_core.process_memory import on_file_mapping, page_out

    save_file({"w": torch.randn(512, 256)}, str(tmp_path / "m.safetensors"))
    with safe_open(tmp_path / "m.safetensors", framework="pt", device="cpu") as handle:
        mapped = handle.get_tensor("w")
        before = mapped.clone()
        assert on_file_mapping(mapped) and not on_file_mapping(before)
        page_out(mapped)
        assert torch.equal(mapped, before)
