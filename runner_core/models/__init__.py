"""ModelAdapterRegistry and the model families: `registry.py` (architecture name -> adapter;
`register_model` for user architectures), one module per family (`llama.py`: Llama, Mistral,
Qwen2, Qwen3; `mixtral.py`, `qwen_moe.py`: the MoE families on `moe.py`), `presets.py` (small
models made from a seed, no download), `config_models.py` (published models by their config alone) and
`catalogue.py` (both kinds of names listed, and the one resolver of a model by name or path)."""

from runner_core.models.catalogue import CatalogueEntry, catalogue, catalogue_names, resolve_model
from runner_core.models.presets import PRESETS, ensure_preset, is_preset, preset_names
from runner_core.models.registry import MODEL_REGISTRY, ModelAdapter, ModelAdapterRegistry, register_model

__all__ = ["MODEL_REGISTRY", "PRESETS", "CatalogueEntry", "ModelAdapter", "ModelAdapterRegistry", "catalogue",
           "catalogue_names", "ensure_preset", "is_preset", "preset_names", "register_model", "resolve_model"]
