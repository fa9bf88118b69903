"""The model catalogue: one resolver of a model by name or path (a directory holding config.json, a preset, a
config-only model), both kinds of names listed with their kind, a config-only model accepted where a config
suffices and refused by the loader with the fix, unknown names answered with every kind, and the one cache
writer (a temporary sibling renamed into place) surviving a lost race."""

import pytest

from runner_core import ModelLoadError, RunnerConfig
from runner_core.cache_dir import build_cached
from runner_core.errors import UnknownModelError
from runner_core.loader.model_loader import ModelLoader, resolve_model_path
from runner_core.memory.estimate import estimate_memory
from runner_core.models import config_models, preset_names
from runner_core.models.catalogue import (
    CONFIG_ONLY,
    PRESET,
    catalogue,
    catalogue_entry,
    catalogue_names,
    resolve_model,
)


def test_both_kinds_are_listed_in_one_place_with_their_kind():
    assert catalogue_names() == [*preset_names(), *config_models.CONFIG_MODELS]
    assert catalogue_names(PRESET) == preset_names()
    assert catalogue_names(CONFIG_ONLY) == list(config_models.CONFIG_MODELS)
    tiny, big = catalogue_entry("tiny-llama"), catalogue_entry("llama-3-70b")
    assert (tiny.kind, tiny.has_weights, big.kind, big.has_weights) == (PRESET, True, CONFIG_ONLY, False)
    assert "Llama-3-70B" in big.description and catalogue_entry("tiny-speaker").kind == PRESET
    assert catalogue_entry("no-such-model") is None
    assert all(entry.description for entry in catalogue())
    with pytest.raises(ValueError, match="kind 'weights' is not one of preset, config-only"):
        catalogue_names("weights")


def test_each_kind_resolves_through_the_one_resolver(tiny_llama_path, tmp_path):
    assert resolve_model("tiny-llama") == tiny_llama_path == resolve_model_path("tiny-llama")
    config_dir = resolve_model("llama-3-70b")
    assert resolve_model("llama-3-70b") == config_dir  # written once, reused
    assert config_dir.parent.name == "whatif-configs" and (config_dir / "config.json").is_file()
    assert not list(config_dir.glob("*.safetensors"))
    assert resolve_model(str(config_dir)) == config_dir  # a directory holding config.json, as it is
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path == resolve_model_path(str(tmp_path))
    assert resolve_model_path("llama-3.1-8b", weights=False) == resolve_model("llama-3.1-8b")


def test_a_config_only_model_plans_but_the_loader_refuses_it_with_the_fix():
    estimate = estimate_memory("llama-3.1-8b", dtype="bfloat16", max_model_len=4096, max_num_seqs=1)
    assert estimate.weights_bytes == pytest.approx(2 * 8.03e9, rel=0.05)  # bf16, from config.json alone
    refusal = ("'llama-3.1-8b' is a config-only model: it has no weights, only its published config.json .*To "
               "load it, pass its checkpoint: a directory holding it, or the hub id 'meta-llama/Llama-3.1-8B' "
               r"\(fetched with `hf download meta-llama/Llama-3.1-8B`\); to plan it without weights, simulate it "
               r"\(what-if\) or call estimate_memory")
    with pytest.raises(ModelLoadError, match=refusal):
        resolve_model("llama-3.1-8b", weights=True)
    with pytest.raises(ModelLoadError, match=refusal):
        ModelLoader(RunnerConfig({"model": "llama-3.1-8b", "dtype": "float32", "device": "cpu"})).load()


def test_an_unknown_model_is_answered_with_every_kind(tmp_path):
    kinds = (r"pass a directory holding config.json, a preset \(tiny-llama, small-llama.*tiny-speaker, "
             r"tiny-speaker-draft\) or a config-only model \(llama-3-70b, llama-3.1-8b.*qwen3-30b-a3b; no weights")
    with pytest.raises(UnknownModelError, match=r"unknown model 'no-such-model' \(no such directory\): " + kinds):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match=f"{tmp_path} has no config.json\\): " + kinds):  # a ValueError too
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ModelLoadError, match="weights.bin is a file\\): " + kinds):  # and a ModelLoadError
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_the_cache_writer_survives_a_lost_race_and_cleans_up_a_failure(tmp_path, monkeypatch):
    final = tmp_path / "cache" / "model-0123456789"

    def build_while_another_process_finishes(out):
        final.mkdir(parents=True)
        (final / "winner").write_text("")
        (out / "loser").write_text("")

    assert build_cached(final, build_while_another_process_finishes) == final
    assert [p.name for p in final.iterdir()] == ["winner"]
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temporary sibling left
    assert build_cached(final, lambda out: pytest.fail("built again")) == final  # there: not rebuilt

    def fail(out):
        (out / "half").write_text("")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_cached(tmp_path / "cache" / "other", fail)
    assert [p.name for p in final.parent.iterdir()] == [final.name]

    # the config-only models' writes go through the same writer
    monkeypatch.setenv("RUNNER_WORKBENCH_CACHE", str(tmp_path / "second"))
    written = config_models.config_model_dir("llama-3-70b")
    real = config_models.hf_config

    class RaceLost:
        def save_pretrained(self, out):
            real("llama-3-70b").save_pretrained(written)  # the other process renamed its copy in first
            (out / "loser").write_text("")

    monkeypatch.setattr(config_models, "hf_config", lambda name: RaceLost())
    assert resolve_model("llama-3-70b") == written
    assert [p.name for p in written.iterdir()] == ["config.json"]
    assert [p.name for p in written.parent.iterdir()] == [written.name]


def test_a_served_dashboard_takes_a_catalogue_name_of_either_kind_as_it_is(tmp_path):
    from workbench.runtime.model_roots import ModelPathRefused, ModelRoots

    roots = ModelRoots([tmp_path])
    assert [roots.check(name) for name in ("tiny-llama", "llama-3-70b")] == ["tiny-llama", "llama-3-70b"]
    with pytest.raises(ModelPathRefused, match="outside the folders"):
        roots.check("no-such-model")
