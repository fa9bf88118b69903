"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): GQA, rope scaling, qkv bias, per-head q/k
RMSNorm (Qwen3), explicit head_dim, tied embeddings. Other families build on it through
`make_layer` (the decoder layer for a layer index).

Runs over a flat batch of tokens ([N] ids and positions) and a paged KV pool; loads
Hugging Face checkpoint names onto fused qkv / gate_up projections.

With pipeline parallelism (a `PipelineStage` active at construction) the model holds only
its stage: decoder layers [start_layer, end_layer) renumbered from 0, the embedding on the
first stage, the final norm and LM head on the last. A stage receives the previous stage's
hidden states (the residual stream, [N, hidden]) and sends its own to the next one inside
`forward`, so every forward path (engine step, stateless forward, profile and compile
warm-up runs) crosses the stages the same way when all ranks run it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from runner_core.distributed.parallel_state import get_pp_stage, pp_recv, pp_send
from runner_core.layers.activation import SiluAndMul
from runner_core.layers.attention import Attention
from runner_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runner_core.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
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
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def rope_settings(config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    scaling = params or getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta), scaling


def sliding_window(config) -> int | None:
    """The one sliding window every layer uses (None: full attention). Per-layer mixes of full and
    sliding attention (`layer_types`) are refused: the step's metadata holds one window."""
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "use_sliding_window", True) is False or window is None or types == {"full_attention"}:
        return None
    if types - {"sliding_attention"}:
        raise ValueError(f"layer_types mixes {', '.join(sorted(types))} (a sliding window of {window} on some layers "
                         "only); the runner applies one window to every layer: use a checkpoint with "
                         "use_sliding_window=false (the transformers fallback refuses such mixes too)")
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, qk_norm: bool = False):
        """`qk_norm`: RMSNorm over each head of q and k before rope (Qwen3)."""
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv_bias = (getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)
                    or config.model_type == "qwen2")  # Qwen2-MoE: `qkv_bias`
        o_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding.shared(config, self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = q.shape[0]
        q, k = q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
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
    def __init__(self, config, qk_norm: bool = False, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward block (default: the gated MLP; MoE families pass their experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config, make_layer):
        """`make_layer(config, layer_index)`: the decoder layer at a (global) layer index."""
        super().__init__()
        stage = get_pp_stage()
        self.stage = stage if stage is not None and stage.size > 1 else None
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = (stage.start_layer, stage.end_layer) if self.stage else (0, n)
        self.hidden_size = config.hidden_size
        first, last = self.stage is None or self.stage.is_first, self.stage is None or self.stage.is_last
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if first else None
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(self.start_layer, self.end_layer))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None

    def forward(self, input_ids, positions):
        """Hidden states [N, hidden] after the final norm. A pipeline stage receives the previous
        stage's residual stream and sends its own to the next one (hidden + residual, which the
        next layer's norm would form anyway, so the result is bit-identical to one process)."""
        stage = self.stage
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(input_ids)
        else:
            w = self.layers[0].input_layernorm.weight
            hidden_states = pp_recv((input_ids.shape[0], self.hidden_size), w.dtype, w.device, stage.prev_rank)
        # a zero residual makes every layer's call identical, so regional compilation reuses one graph
        residual = torch.zeros_like(hidden_states)
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self.norm is None:
            hidden_states = hidden_states + residual
            pp_send(hidden_states, stage.next_rank)
            return hidden_states
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Entry point registered for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM.

    The runner's model contract (what the engine reads of any model): `forward(input_ids [N],
    positions [N]) -> hidden [N, H]` over the flat batch, attention through `layers.attention.Attention`;
    `compute_logits(hidden)`; `load_weights(iterable of (name, tensor)) -> names loaded`; and the
    attributes `num_layers` (held here), `num_kv_heads` (per rank), `head_dim`, `sliding_window`."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.sliding_window = sliding_window(config)  # refuses what the step cannot express, before building
        self.model = LlamaModel(config, self.make_layer)
        last = self.model.norm is not None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if last else None
        if config.tie_word_embeddings and last and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_layers = len(self.model.layers)  # decoder layers held here (this stage's)

    @staticmethod
    def make_layer(config, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] of a flat batch (attention metadata and the KV pool come
        from the forward context)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab]; a pipeline stage without the LM head returns an empty [S, 0]."""
        if self.lm_head is None:
            return hidden_states.new_empty(hidden_states.shape[0], 0)
        return self.lm_head.compute_logits(hidden_states)

    def _local_name(self, name: str) -> str | None:
        """The parameter name of checkpoint tensor `name` in this model, or None when it belongs
        to another pipeline stage (then it is not read at all)."""
        tied = self.config.tie_word_embeddings
        if name == "lm_head.weight" and tied:
            return None
        if self.model.stage is None:
            return name
        m = _LAYER_NAME.match(name)
        if m:
            i = int(m.group(1))
            if self.model.start_layer <= i < self.model.end_layer:
                return f"model.layers.{i - self.model.start_layer}.{m.group(2)}"
            return None if i < self.config.num_hidden_layers else name
        if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
            return "lm_head.weight" if tied and self.lm_head is not None else None
        if ((name == "model.norm.weight" and self.model.norm is None)
                or (name == "lm_head.weight" and self.lm_head is None)):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = None if "rotary_emb.inv_freq" in ckpt_name else self._local_name(ckpt_name)
            if name is None:
                continue
            for ckpt_part, fused_part, shard_id in STACKED_PARAMS:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, fused_part)
                    if target not in params:
                        continue
                    self._load(params[target], ckpt_name, tensor, shard_id)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor '{ckpt_name}' has no matching parameter in "
                                     f"{type(self).__name__}")
                self._load(params[name], ckpt_name, tensor, None)
                loaded.add(name)
        if self.config.tie_word_embeddings and self.lm_head is not None:
            loaded.add("lm_head.weight")
        return loaded

    @staticmethod
    def _load(param: nn.Parameter, name: str, tensor: torch.Tensor, shard_id) -> None:
        """`tensor` in the checkpoint's dtype: the loaders copy it into the parameter (copy_ converts as it goes)
        or hand it whole to the layer's storage, which converts a chunk of rows at a time; a whole converted copy
        first would be one more copy of the tensor (544 MiB for qwen2.5-0.5b's tied embedding in float32)."""
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"'{name}': {e}") from None


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: the Llama layout with RMSNorm over each head of q and k before rope."""

    @staticmethod
    def make_layer(config, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(config, qk_norm=True)
