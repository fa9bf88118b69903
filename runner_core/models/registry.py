"""Model adapter registry: Hugging Face `architectures` names -> runner model classes.

Targets are "module:Class" strings imported on first use, so registering a family
costs nothing until a checkpoint of that family is loaded.
"""

from __future__ import annotations

import importlib

from runner_core.errors import ModelLoadError

# Checkpoints that predate `architectures` in config.json still carry a model_type.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelAdapterRegistry:
    """Maps architecture names to model classes (or lazy "module:Class" targets)."""

    def __init__(self) -> None:
        self._targets: dict[str, str | type] = {}

    def register(self, arch: str, target: str | type) -> None:
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"target {target!r} for {arch!r} must be a class or a 'module:Class' string")
        self._targets[arch] = target

    def supported(self) -> list[str]:
        return sorted(self._targets)

    def resolve(self, hf_config) -> type:
        """The model class for `hf_config`: the first registered name in its
        `architectures`, else the class of its `model_type`."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            model_type = getattr(hf_config, "model_type", None)
            archs = [_MODEL_TYPE_TO_ARCH.get(model_type, f"model_type={model_type}")]
        for arch in archs:
            if arch in self._targets:
                return self._load(arch)
        raise ModelLoadError(
            f"architecture {', '.join(archs)!r} is not supported; supported: {', '.join(self.supported())}"
        )

    def _load(self, arch: str) -> type:
        target = self._targets[arch]
        if isinstance(target, type):
            return target
        module_name, _, class_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ModelLoadError(f"cannot import {target} for architecture {arch!r}: {exc}") from exc
        self._targets[arch] = cls
        return cls


MODEL_REGISTRY = ModelAdapterRegistry()
for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
    MODEL_REGISTRY.register(_arch, "runner_core.models.llama:LlamaForCausalLM")
MODEL_REGISTRY.register("Qwen3ForCausalLM", "runner_core.models.llama:Qwen3ForCausalLM")
