"""ModelAdapterRegistry (the seed's section 3.7): architecture names -> how the runner builds them.

An adapter says which model class builds an architecture, by which path — "native" (a module of
`models/` built from the runner's layers, or a class a user registered) or "transformers" (the
fallback: a Hugging Face causal LM run on the runner's paged KV cache) — and of which kind (the
seed's three adapters: "causal_lm", "moe", "multimodal"). `model_impl` chooses the path: "auto" (a
native adapter when there is one, else the fallback), "native", "transformers". Targets may be
"module:Class" strings, imported on first use, so registering a family costs nothing until a
checkpoint of it is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from runner_core.errors import ModelLoadError

KINDS = ("causal_lm", "moe", "multimodal")
# Checkpoints that predate `architectures` in config.json still carry a model_type.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelAdapter:
    """What `get_adapter` chose for a checkpoint."""

    architecture: str
    impl: str  # "native" or "transformers"
    kind: str  # one of KINDS
    model_class: type
    reason: str  # why this path (logged at load, in ModelRunner.model_info())


class ModelAdapterRegistry:
    """Maps architecture names to model classes (or lazy "module:Class" targets) and their kind."""

    def __init__(self) -> None:
        self._targets: dict[str, tuple[str | type, str]] = {}

    def register(self, architecture: str, target: str | type, *, kind: str = "causal_lm") -> None:
        if not isinstance(architecture, str) or not architecture:
            raise ValueError(f"architecture must be a non-empty string (config.json's 'architectures'), "
                             f"got {architecture!r}")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"target {target!r} for {architecture!r} must be a class or a 'module:Class' string")
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} for {architecture!r} is not one of {', '.join(KINDS)}")
        self._targets[architecture] = (target, kind)

    def native_architectures(self) -> list[str]:
        return sorted(self._targets)

    def supported_architectures(self) -> dict[str, str]:
        """Architecture -> "native" for every registered adapter."""
        return dict.fromkeys(self.native_architectures(), "native")

    @staticmethod
    def architectures(hf_config) -> list[str]:
        """The checkpoint's `architectures`, else the architecture of its `model_type`."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            model_type = getattr(hf_config, "model_type", None)
            archs = [_MODEL_TYPE_TO_ARCH.get(model_type, f"model_type={model_type}")]
        return archs

    def get_adapter(self, hf_config, model_impl: str = "auto") -> ModelAdapter:
        """The adapter for `hf_config` (the seed's `get_adapter`): the first registered name in its
        `architectures` (native), as `model_impl` allows."""
        archs = self.architectures(hf_config)
        native = next((a for a in archs if a in self._targets), None)
        if native is not None and model_impl in ("auto", "native"):
            target, kind = self._targets[native]
            why = "model_impl='native'" if model_impl == "native" else "auto: a native adapter is registered"
            return ModelAdapter(architecture=native, impl="native", kind=kind, model_class=self._load(native),
                                reason=why)
        names = ", ".join(archs)
        if model_impl == "native":
            raise ModelLoadError(f"architecture {names!r} has no native adapter (native: "
                                 f"{', '.join(self.native_architectures())}); use model_impl='auto' or "
                                 "'transformers' to run it through the transformers fallback")
        raise ModelLoadError(f"architecture {names!r} is not supported; supported: "
                             f"{', '.join(self.native_architectures())}")

    def _load(self, architecture: str) -> type:
        target, kind = self._targets[architecture]
        if isinstance(target, type):
            return target
        module_name, _, class_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ModelLoadError(f"cannot import {target} for architecture {architecture!r}: {exc}") from exc
        self._targets[architecture] = (cls, kind)
        return cls


MODEL_REGISTRY = ModelAdapterRegistry()
for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
    MODEL_REGISTRY.register(_arch, "runner_core.models.llama:LlamaForCausalLM")
MODEL_REGISTRY.register("Qwen3ForCausalLM", "runner_core.models.llama:Qwen3ForCausalLM")
MODEL_REGISTRY.register("MixtralForCausalLM", "runner_core.models.mixtral:MixtralForCausalLM", kind="moe")
MODEL_REGISTRY.register("Qwen2MoeForCausalLM", "runner_core.models.qwen_moe:Qwen2MoeForCausalLM", kind="moe")
MODEL_REGISTRY.register("Qwen3MoeForCausalLM", "runner_core.models.qwen_moe:Qwen3MoeForCausalLM", kind="moe")

# What the engine reads of every model (see LlamaForCausalLM's docstring for the full contract).
MODEL_CONTRACT = ("forward", "compute_logits", "load_weights")
MODEL_ATTRIBUTES = ("num_layers", "num_kv_heads", "head_dim", "sliding_window")


def register_model(architecture: str, model_cls: type, *, kind: str = "causal_lm") -> None:
    """Register a user architecture (the seed's section 2.5): checkpoints whose config.json names
    `architecture` are built with `model_cls(hf_config)` (under `model_impl` "auto" or "native").
    The class must follow the model contract: forward(input_ids [N], positions [N]) -> hidden
    [N, H] over the flat batch with attention through `runner_core.layers.attention.Attention`,
    compute_logits(hidden) -> [N, vocab], load_weights(iterable of (name, tensor)) -> set of loaded
    parameter names, and attributes num_layers, num_kv_heads, head_dim, sliding_window (set in
    __init__). Methods are checked here, attributes when the model is built."""
    if not isinstance(model_cls, type):
        raise TypeError(f"register_model({architecture!r}, ...) takes a model class, got {type(model_cls).__name__}")
    missing = [m for m in MODEL_CONTRACT if not callable(getattr(model_cls, m, None))]
    if missing:
        raise TypeError(f"{model_cls.__name__} cannot run on the runner: it has no {', '.join(missing)} "
                        f"(the model contract: {', '.join(MODEL_CONTRACT)}; see runner_core.register_model)")
    MODEL_REGISTRY.register(architecture, model_cls, kind=kind)
