"""ModelAdapterRegistry and the model families: `registry.py` (architecture name -> adapter;
`register_model` for user architectures), one module per family (`llama.py`: Llama, Mistral,
Qwen2, Qwen3; `mixtral.py`, `qwen_moe.py`: the MoE families on `moe.py`), and `presets.py` (small
models made from a seed, no download)."""

from runner_core.models.presets import PRESETS, ensure_preset, is_preset, preset_names
from runner_core.models.registry import MODEL_REGISTRY, ModelAdapter, ModelAdapterRegistry, register_model

__all__ = ["MODEL_REGISTRY", "PRESETS", "ModelAdapter", "ModelAdapterRegistry", "ensure_preset", "is_preset",
           "preset_names", "register_model"]
