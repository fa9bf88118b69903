"""Model families, the architecture registry and the built-in presets."""

from runner_core.models.presets import PRESETS, ensure_preset, is_preset, preset_names
from runner_core.models.registry import MODEL_REGISTRY, ModelAdapterRegistry

__all__ = ["MODEL_REGISTRY", "PRESETS", "ModelAdapterRegistry", "ensure_preset", "is_preset", "preset_names"]
