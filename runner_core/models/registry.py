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
import inspect
from dataclasses import dataclass

from runner_core.errors import ConfigError, ModelLoadError

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
    "llava": "LlavaForConditionalGeneration",
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
        """Architecture -> "native" for every registered adapter, "transformers" for the causal LMs
        of transformers the fallback can run (transformers_compat.fallback_architectures)."""
        from runner_core.models.transformers_compat import fallback_architectures

        return {**dict.fromkeys(fallback_architectures(), "transformers"),
                **dict.fromkeys(self.native_architectures(), "native")}

    @staticmethod
    def architectures(hf_config) -> list[str]:
        """The checkpoint's `architectures`, else the architecture of its `model_type`."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            model_type = getattr(hf_config, "model_type", None)
            archs = [_MODEL_TYPE_TO_ARCH.get(model_type, f"model_type={model_type}")]
        return archs

    def get_adapter(self, hf_config, model_impl: str = "auto", *, trust_remote_code: bool = False,
                    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> ModelAdapter:
        """The adapter for `hf_config` (the seed's `get_adapter`): the first registered name in its
        `architectures` (native), as `model_impl` allows, else the transformers fallback (one device
        only; remote code only with `trust_remote_code`)."""
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
                                 "'transformers' to run it through the transformers fallback, or register one "
                                 "with runner_core.register_model")
        from runner_core.models.transformers_backend import TransformersForCausalLM
        from runner_core.models.transformers_compat import resolve_fallback

        try:
            arch, hf_class, why = resolve_fallback(hf_config, archs, trust_remote_code)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc} (native: {', '.join(self.native_architectures())})") from exc
        if tensor_parallel_size * pipeline_parallel_size > 1:
            raise ConfigError(f"architecture {arch!r} runs through the transformers fallback, which runs on one "
                              f"device for now: tensor_parallel_size={tensor_parallel_size} and "
                              f"pipeline_parallel_size={pipeline_parallel_size} need a native adapter; use "
                              f"tensor_parallel_size=1 and pipeline_parallel_size=1 (native: "
                              f"{', '.join(self.native_architectures())})")
        chosen = "model_impl='transformers'" if model_impl == "transformers" else f"auto: no native adapter for {arch}"
        return ModelAdapter(architecture=arch, impl="transformers", kind="causal_lm",
                            model_class=TransformersForCausalLM.for_class(hf_class), reason=f"{chosen}; {why}")

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
MODEL_REGISTRY.register("LlavaForConditionalGeneration", "runner_core.models.llava:LlavaForConditionalGeneration",
                        kind="multimodal")

# What the engine reads of every model (see LlamaForCausalLM's docstring for the full contract).
MODEL_CONTRACT = ("forward", "compute_logits", "load_weights")
MODEL_ATTRIBUTES = ("num_layers", "num_kv_heads", "head_dim", "sliding_window")


def register_model(architecture: str, model_cls: type, *, kind: str = "causal_lm") -> None:
    """Register a user architecture (the seed's section 2.5): checkpoints whose config.json names
    `architecture` in `architectures` are then built with `model_cls` (under `model_impl` "auto" or
    "native"; it takes precedence over the transformers fallback).

    The model contract (what the engine reads of every model; `LlamaForCausalLM` is an example):

    * **constructor** `model_cls(hf_config)`: the transformers config read from config.json
      (`AutoConfig`: its `model_type` must be known to transformers, or its config class registered
      with `transformers.AutoConfig.register`; the memory plan reads its `num_hidden_layers`,
      `hidden_size`, `num_attention_heads`, `vocab_size`, `max_position_embeddings`, and
      `num_key_value_heads` / `head_dim` / `intermediate_size` when they differ from the defaults).
      It runs under the runner's dtype (the default dtype) and device (a `torch.device` context), so
      parameters made with `torch.empty` land where they belong; `load_weights` fills them.
    * **forward** `forward(input_ids [N], positions [N]) -> hidden [N, H]`: one flat batch of every
      token of the step (decodes first, then prefill chunks), no batch dimension and no mask. Every
      attention layer is a `runner_core.layers.attention.Attention(num_heads, head_dim, scale,
      num_kv_heads)` called as `attn(q [N, H*D], k [N, KVH*D], v [N, KVH*D])` after rotary; it writes
      and reads this layer's slice of the paged KV pool (bound by the MemoryManager to every
      `Attention` module in model order) through the step's metadata, which comes from the forward
      context. Build the rest from `runner_core.layers` (parallel linears, embedding, RMSNorm, rotary).
    * **compute_logits** `compute_logits(hidden [S, H]) -> [S, vocab]` for the rows that sample.
    * **load_weights** `load_weights(iterable of (hf_name, tensor)) -> set of parameter names
      loaded`: the tensors of the checkpoint's safetensors files (never pickle), one at a time, as
      named in the files; the loader refuses the checkpoint when a named parameter is not in the
      returned set.
    * **attributes** set in `__init__`: `num_layers` (its `Attention` layers), `num_kv_heads` (per
      rank), `head_dim`, `sliding_window` (an int applied to every layer, or None).

    Methods and the constructor and forward signatures are checked here (TypeError naming what is
    missing); the attributes when the model is built (ModelLoadError)."""
    if not isinstance(model_cls, type):
        raise TypeError(f"register_model({architecture!r}, ...) takes a model class, got {type(model_cls).__name__}")
    missing = [m for m in MODEL_CONTRACT if not callable(getattr(model_cls, m, None))]
    if missing:
        raise TypeError(f"{model_cls.__name__} cannot run on the runner: it has no {', '.join(missing)} "
                        f"(the model contract: {', '.join(MODEL_CONTRACT)}; see runner_core.register_model)")
    for what, fn, args, expected in (("constructor", model_cls, ("hf_config",), "model_cls(hf_config)"),
                                     ("forward", model_cls.forward, ("self", "input_ids", "positions"),
                                      "forward(input_ids, positions)")):
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            raise TypeError(f"{model_cls.__name__}'s {what} takes {inspect.signature(fn)}, but the runner calls "
                            f"{expected} (the model contract; see runner_core.register_model)") from None
        except ValueError:  # no signature to read (a builtin): nothing to check
            pass
    MODEL_REGISTRY.register(architecture, model_cls, kind=kind)
