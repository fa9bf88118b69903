"""Llama-family decoder (Llama, Mistral, Qwen2): GQA, rope scaling, qkv bias, tied embeddings.

Runs over a flat batch of tokens ([N] ids and positions) and a paged KV pool; loads
Hugging Face checkpoint names onto fused qkv / gate_up projections.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from runner_core.layers.activation import SiluAndMul
from runner_core.layers.attention import Attention
from runner_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runner_core.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, default_weight_loader
from runner_core.layers.norm import RMSNorm
from runner_core.layers.rotary import RotaryEmbedding

# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def rope_settings(config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    scaling = params or getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta), scaling


def sliding_window(config) -> int | None:
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        o_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)

    def forward(self, positions, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = q.shape[0]
        q, k = self.rotary_emb(positions, q.view(n, self.num_heads, self.head_dim),
                               k.view(n, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens(input_ids)
        # a zero residual makes every layer's call identical, so regional compilation reuses one graph
        residual = torch.zeros_like(hidden_states)
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Entry point registered for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.sliding_window = sliding_window(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] of a flat batch (attention metadata and the KV pool come
        from the forward context)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            for ckpt_part, fused_part, shard_id in STACKED_PARAMS:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, fused_part)
                    if target not in params:
                        continue
                    self._load(params[target], name, tensor, shard_id)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor '{name}' has no matching parameter in {type(self).__name__}")
                self._load(params[name], name, tensor, None)
                loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded

    @staticmethod
    def _load(param: nn.Parameter, name: str, tensor: torch.Tensor, shard_id) -> None:
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"'{name}': {e}") from None
