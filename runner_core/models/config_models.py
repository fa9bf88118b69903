"""Published models by their config alone, for the what-if simulator: no weights, just the config.json
that transformers' own config class writes for the published shape, cached under
`$RUNNER_WORKBENCH_CACHE/whatif-configs/<name>-<hash of the spec>/` (by `cache_dir.build_cached`, as presets
are). `runner_core.models.catalogue` resolves their names, beside the presets', into the directory the
simulated runner and `estimate_memory` read, and refuses them where weights are needed.

Every field below is the published config.json's (the Hugging Face model repositories named in each
entry's `source`); fields left out take the config class's default, which equals the published value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runner_core.cache_dir import build_cached, cache_root

_RECIPE_VERSION = 1
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ConfigModel:
    """A published model's shape: transformers' config class, its architecture and config fields."""

    description: str
    config_class: str
    architecture: str
    fields: dict
    source: str
    parameters: float  # the published parameter count (the tests check the shape against it)
    rope: dict = field(default_factory=dict)  # beyond {"rope_type": "default", "rope_theta": ...}

    @property
    def hub_id(self) -> str:
        """The Hugging Face repository of the published checkpoint (from `source`), e.g. "meta-llama/Llama-3.1-8B"."""
        return self.source.removeprefix("https://huggingface.co/").split("/blob/")[0]


_LLAMA_COMMON = {"rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                 "tie_word_embeddings": False, "dtype": "bfloat16"}

CONFIG_MODELS: dict[str, ConfigModel] = {
    # Llama 3 (not 3.1): 8192 positions, no rope scaling; 3.1-70B has the same layers with 131072 positions
    # and llama3 rope scaling (factor 8). MLPerf and the engines' published 70B runs use either; the shape
    # (and so the step time) is the same.
    "llama-3-70b": ConfigModel(
        description="Llama-3-70B (GQA 64/8, 80 layers, vocabulary 128256, 8192 positions)",
        config_class="LlamaConfig", architecture="LlamaForCausalLM", parameters=70.55e9,
        source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
        fields={"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001, **_LLAMA_COMMON}),
    "llama-3.1-8b": ConfigModel(
        description="Llama-3.1-8B (GQA 32/8, 32 layers, vocabulary 128256, 131072 positions, llama3 rope scaling)",
        config_class="LlamaConfig", architecture="LlamaForCausalLM", parameters=8.03e9,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        fields={"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001, **_LLAMA_COMMON},
        rope=_LLAMA3_ROPE),
    "llama-2-70b": ConfigModel(
        description="Llama-2-70B (GQA 64/8, 80 layers, vocabulary 32000, 4096 positions): MLPerf's llama2-70b",
        config_class="LlamaConfig", architecture="LlamaForCausalLM", parameters=68.98e9,
        source="https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json",
        fields={"vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 4096,
                "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, **_LLAMA_COMMON}),
    "mixtral-8x7b": ConfigModel(
        description="Mixtral-8x7B (8 experts, top-2, GQA 32/8, 32 layers, vocabulary 32000, 32768 positions)",
        config_class="MixtralConfig", architecture="MixtralForCausalLM", parameters=46.70e9,
        source="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
        fields={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
                "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                "dtype": "bfloat16"}),
    "qwen3-30b-a3b": ConfigModel(
        description="Qwen3-30B-A3B (128 experts of 768, top-8, GQA 32/4, head 128, 48 layers, vocabulary 151936)",
        config_class="Qwen3MoeConfig", architecture="Qwen3MoeForCausalLM", parameters=30.53e9,
        source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        fields={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "max_position_embeddings": 40960, "rope_theta": 1e6, "num_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16"}),
}


def config_model_dir(name: str) -> Path:
    """Where the config of `name` lives once written (the directory name carries a hash of its spec)."""
    spec = _spec(name)
    blob = json.dumps({"recipe": _RECIPE_VERSION, "name": name, **asdict(spec)}, sort_keys=True)
    return cache_root() / "whatif-configs" / f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def hf_config(name: str):
    """transformers' config of model `name` (rope settings in `rope_parameters`, as transformers 5 keeps them)."""
    import transformers

    spec = _spec(name)
    fields = dict(spec.fields)
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"), **spec.rope}
    return getattr(transformers, spec.config_class)(**fields, rope_parameters=rope, architectures=[spec.architecture])


def ensure_config_model(name: str) -> Path:
    """The directory holding config.json of model `name`, written on first use."""
    return build_cached(config_model_dir(name), lambda out: hf_config(name).save_pretrained(out))


def _spec(name: str) -> ConfigModel:
    if name not in CONFIG_MODELS:
        raise ValueError(f"unknown config model {name!r}; config models: {', '.join(CONFIG_MODELS)}")
    return CONFIG_MODELS[name]
