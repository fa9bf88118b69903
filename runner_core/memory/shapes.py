"""Checkpoint shapes and per-device weight counts: what the memory formulas need from
config.json and the safetensors headers, and how many parameter elements each device holds.

Per-device rules follow the runner's layers: with tensor parallelism each device holds
1/tp of every projection, of the (padded) vocabulary rows of the embedding and LM head,
and max(1, kv_heads/tp) KV heads (KV heads replicate when there are fewer than ranks);
norms and row-parallel biases replicate. With pipeline parallelism stage s holds its
contiguous share of the layers (`stage_layer_ranges`: as configured, else earlier stages
take the remainder), the embedding lives on the first stage, the final norm and LM head on
the last (tied embeddings count once unless those are different stages). MoE layers: every
expert's gate/up/down is split like an MLP's (1/tp each); the router and the shared-expert gate
replicate.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from runner_core.config import dtype_bytes
from runner_core.errors import ConfigError, ModelLoadError
from runner_core.models.moe_spec import MoESpec

MiB = 2**20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MAX_HEADER = 256 * MiB
_MLP_WIDTH_NAMES = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")


# ---- what the formulas need from config.json ------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # per-head q/k RMSNorm weights (Qwen3)
    moe: MoESpec | None = None  # experts (None: a dense model)
    model_type: str = "llama"

    @classmethod
    def from_hf_config(cls, cfg) -> ModelShape:
        """The text model's shape (a multimodal config's `text_config`). Other families name some fields
        differently: transformers' `attribute_map` covers the common names (n_layer, n_head, ...); the
        MLP width falls back to its other names, else 4 x hidden (an estimate); multi-query attention
        (GPTBigCode) has one KV head."""
        cfg = cfg.get_text_config()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or (1 if getattr(cfg, "multi_query", False) else heads)
        inter = next((v for v in (getattr(cfg, n, None) for n in _MLP_WIDTH_NAMES) if v), 4 * cfg.hidden_size)
        try:
            moe = MoESpec.from_hf_config(cfg)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
            intermediate_size=inter, vocab_size=cfg.vocab_size, num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=(bool(getattr(cfg, "attention_bias", False)) or bool(getattr(cfg, "qkv_bias", False))
                      or getattr(cfg, "model_type", "") == "qwen2"),
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=getattr(cfg, "model_type", "") in ("qwen3", "qwen3_moe"),
            moe=moe, model_type=getattr(cfg, "model_type", "llama"),
        )

    @property
    def dense_layers(self) -> list[int]:
        """The layers with a plain MLP of `intermediate_size`."""
        sparse = set(self.moe.sparse_layers) if self.moe else set()
        return [n for n in range(self.num_layers) if n not in sparse]

    def kv_heads_per_device(self, tp: int) -> int:
        return max(1, self.num_kv_heads // tp)

    def tp_problem(self, tp: int) -> str | None:
        """Why tensor_parallel_size `tp` cannot split this model's layers, or None when it can."""
        heads, kv = self.num_heads, self.num_kv_heads
        if heads % tp:
            return (f"tensor_parallel_size={tp} does not divide num_attention_heads={heads}: attention heads "
                    f"are split evenly across the ranks; use one of {_divisors(heads)}")
        if kv >= tp and kv % tp:
            return (f"tensor_parallel_size={tp} does not divide num_key_value_heads={kv}; use a divisor "
                    f"of {kv} or a multiple of it that divides {heads}")
        if kv < tp and tp % kv:
            return (f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={kv}: with fewer "
                    f"KV heads than ranks each KV head is replicated on tp/kv_heads ranks")
        widths = [("intermediate_size", self.intermediate_size, "the MLP width")] if self.dense_layers else []
        if self.moe is not None and self.moe.sparse_layers:
            field = "intermediate_size" if self.model_type == "mixtral" else "moe_intermediate_size"
            widths.append((field, self.moe.intermediate_size, "each expert's width: gate/up split by columns"))
            if self.moe.shared_expert_intermediate_size:
                widths.append(("shared_expert_intermediate_size", self.moe.shared_expert_intermediate_size,
                               "the shared expert's width"))
        for field, width, what in widths:
            if width % tp:
                return f"tensor_parallel_size={tp} does not divide {field}={width} ({what})"
        return None

    def checkpoint_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (name, shape) list of a Llama-family checkpoint with this shape (HF names)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        out = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
            if self.moe is not None and self.moe.is_sparse(n):
                out += self._expert_tensors(p)
            else:
                out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                        (p + "mlp.down_proj.weight", (h, i))]
            if self.qkv_bias:
                out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                        (p + "self_attn.v_proj.bias", (kv,))]
            if self.o_bias:
                out.append((p + "self_attn.o_proj.bias", (h,)))
            if self.qk_norm:
                out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
            if self.mlp_bias:
                out += [(p + "mlp.gate_proj.bias", (i,)), (p + "mlp.up_proj.bias", (i,)),
                        (p + "mlp.down_proj.bias", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    def _expert_tensors(self, p: str) -> list[tuple[str, tuple[int, ...]]]:
        """An MoE layer's tensors under the per-expert names `save_pretrained` writes."""
        moe, h = self.moe, self.hidden_size
        i, e = moe.intermediate_size, moe.num_experts
        if self.model_type == "mixtral":
            block, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            block, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        out = [(block + "gate.weight", (e, h))]
        for x in range(e):
            out += [(f"{block}experts.{x}.{names[0]}.weight", (i, h)),
                    (f"{block}experts.{x}.{names[1]}.weight", (i, h)),
                    (f"{block}experts.{x}.{names[2]}.weight", (h, i))]
        s = moe.shared_expert_intermediate_size
        if s:
            shared = block + "shared_expert."
            out += [(shared + "gate_proj.weight", (s, h)), (shared + "up_proj.weight", (s, h)),
                    (shared + "down_proj.weight", (h, s)), (block + "shared_expert_gate.weight", (1, h))]
        return out


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype) -> int:
    """K and V of one token in every layer: layers x 2 x kv_heads x head_dim x dtype bytes."""
    return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes(dtype)


def read_safetensors_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]] | None:
    """(name, shape) of every tensor in the checkpoint at `path`, from the file headers only
    (8-byte little-endian length, then JSON); None when the directory has no safetensors."""
    from runner_core.loader.weight_utils import safetensors_files

    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        return None
    out = []
    for file in safetensors_files(path):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _MAX_HEADER:
                    raise ValueError(f"header length {size} is implausible")
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(
                f"safetensors file {file} has a corrupt header ({exc}); download or save it again") from exc
        out += [(name, tuple(meta["shape"])) for name, meta in header.items() if name != "__metadata__"]
    return out


# ---- per-device weights -----------------------------------------------------------------------
def _numel_per_device(name: str, shape: tuple[int, ...], tp: int, shape_info: ModelShape) -> int:
    numel = math.prod(shape)
    if tp == 1:
        return numel
    if "embed_tokens" in name or name.startswith("lm_head"):
        return -(-shape[0] // tp) * math.prod(shape[1:])  # vocabulary rows, padded to equal shards
    if len(shape) == 1 and "norm" in name:
        return numel
    if name.endswith((".gate.weight", "shared_expert_gate.weight")):
        return numel  # MoE router and shared-expert gate: replicated
    if "k_proj" in name or "v_proj" in name:
        kv = shape_info.num_kv_heads
        return numel // tp if kv >= tp else numel // kv  # fewer KV heads than ranks: one head each
    if name.endswith("bias") and ("o_proj" in name or "down_proj" in name):
        return numel  # row-parallel bias, added once after the reduction
    return -(-numel // tp)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def stage_layer_ranges(num_layers: int, pp: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Decoder layers of each pipeline stage: `layers_per_stage` when given (refused with a
    ConfigError unless it adds up to `num_layers`), else an even split in which the earlier
    stages take the remainder."""
    if pp > num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} decoder layers: every "
                          f"stage needs at least one layer; use pipeline_parallel_size <= {num_layers}")
    if layers_per_stage is None:
        base, extra = divmod(num_layers, pp)
        layers_per_stage = [base + (1 if s < extra else 0) for s in range(pp)]
    elif sum(layers_per_stage) != num_layers or len(layers_per_stage) != pp:
        raise ConfigError(f"pipeline_stage_layers={layers_per_stage} adds up to {sum(layers_per_stage)} layers but "
                          f"the model has {num_layers}; give {pp} counts that add up to {num_layers}")
    bounds, start = [], 0
    for n in layers_per_stage:
        bounds.append(range(start, start + n))
        start += n
    return bounds


def weights_per_stage(tensors, shape: ModelShape, tp: int, stages: list[range]) -> list[int]:
    """Parameter elements held by one device of each pipeline stage (`stages`: their layers)."""
    pp = len(stages)
    stage_of_layer = {layer: s for s, r in enumerate(stages) for layer in r}
    numel = [0] * pp
    for name, dims in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name.startswith("lm_head") and shape.tie_word_embeddings:
            continue  # tied: the embedding is the LM head
        n = _numel_per_device(name, dims, tp, shape)
        m = _LAYER.search(name)
        if m:
            numel[stage_of_layer.get(int(m.group(1)), pp - 1)] += n
        elif name.startswith("lm_head") or name.endswith("model.norm.weight") or name == "norm.weight":
            numel[pp - 1] += n
        else:
            numel[0] += n
            if "embed_tokens" in name and shape.tie_word_embeddings and pp > 1:
                numel[pp - 1] += n  # the last stage needs its own copy as the LM head
    return numel
