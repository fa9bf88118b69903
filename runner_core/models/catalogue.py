"""The model catalogue: every model a name stands for, listed with its kind, and the one resolver of a model
given by name or path.

Two kinds of names, listed together by `catalogue()` and `catalogue_names()` (the UIs' model lists):

* "preset": a model with weights, built from a seed into the cache on first use or shipped trained
  (runner_core.models.presets);
* "config-only": a published model by its config.json alone, no weights (runner_core.models.config_models),
  for what a config suffices for: estimate_memory, the simulator, what-if.

`resolve_model(model, weights=...)` turns a directory holding config.json or a catalogue name into the
directory to read (a preset built, a config written, on first use; both by `cache_dir.build_cached`). Where
weights are needed (the loader) a config-only model is refused with the fix; anything else is an
UnknownModelError naming every kind. A hub id is the loader's to look up (model_loader.resolve_model_path asks
here first, then the Hugging Face cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner_core.errors import ModelLoadError, UnknownModelError
from runner_core.models.config_models import CONFIG_MODELS, ensure_config_model
from runner_core.models.presets import PRESETS, SHIPPED_PRESETS, ensure_preset

PRESET = "preset"
CONFIG_ONLY = "config-only"
KINDS = (PRESET, CONFIG_ONLY)


@dataclass(frozen=True)
class CatalogueEntry:
    """A named model: its name, its kind (PRESET: with weights; CONFIG_ONLY: a config.json alone) and what it is."""

    name: str
    kind: str
    description: str

    @property
    def has_weights(self) -> bool:
        return self.kind == PRESET


def catalogue() -> list[CatalogueEntry]:
    """Every named model: the presets (built ones, then the shipped trained one), then the config-only models."""
    descriptions = {**{name: spec.description for name, spec in PRESETS.items()}, **SHIPPED_PRESETS}
    return ([CatalogueEntry(name, PRESET, text) for name, text in descriptions.items()]
            + [CatalogueEntry(name, CONFIG_ONLY, model.description) for name, model in CONFIG_MODELS.items()])


def catalogue_names(kind: str | None = None) -> list[str]:
    """The names of the catalogue, or of one of its KINDS."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return [entry.name for entry in catalogue() if kind in (None, entry.kind)]


def catalogue_entry(name: str) -> CatalogueEntry | None:
    """The entry named `name`, or None."""
    return next((entry for entry in catalogue() if entry.name == name), None)


def resolve_model(model: str | Path, *, weights: bool = False) -> Path:
    """The directory of `model`: a directory holding config.json as it is, a preset (built on first use) or,
    unless `weights` are needed, a config-only model (its config.json written on first use). ModelLoadError for
    a config-only model where weights are needed; UnknownModelError naming every kind for anything else."""
    text = str(model)
    path = Path(text).expanduser()
    if (path / "config.json").is_file():
        return path
    entry = catalogue_entry(text)
    if entry is None:
        raise UnknownModelError(_unknown_model_message(text))
    if entry.kind == PRESET:
        return ensure_preset(text)
    if weights:
        hub_id = CONFIG_MODELS[text].hub_id
        raise ModelLoadError(
            f"{text!r} is a config-only model: it has no weights, only its published config.json (for "
            "estimate_memory, the simulator and what-if). To load it, pass its checkpoint: a directory holding it, "
            f"or the hub id {hub_id!r} (fetched with `hf download {hub_id}`); to plan it without weights, "
            f"simulate it (what-if) or call estimate_memory({text!r})")
    return ensure_config_model(text)


def _unknown_model_message(model: str) -> str:
    """Why `model` names no model, and every kind that would."""
    path = Path(model).expanduser()
    why = (f"{path} has no config.json" if path.is_dir() else f"{path} is a file" if path.exists()
           else "no such directory")
    return (f"unknown model {model!r} ({why}): pass a directory holding config.json, a preset "
            f"({', '.join(catalogue_names(PRESET))}) or a config-only model ({', '.join(catalogue_names(CONFIG_ONLY))}"
            "; no weights: estimates, the simulator and what-if only)")
