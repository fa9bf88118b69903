"""Tiny random-weight MoE checkpoints for tests (Mixtral, Qwen2-MoE, Qwen3-MoE), built locally with
transformers' classes and `save_pretrained` (which writes per-expert names), or rewritten into the
fused layout (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.helpers import save_random_model

INIT = 0.15
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=INIT, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
FAMILIES = {  # name -> (config class, model class, family fields)
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=6, num_experts_per_tok=2)),
    # a shared expert, a dense middle layer, top-k left unnormalised, qkv bias
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    # every second layer sparse, top-3 renormalised, q/k norm, explicit head_dim
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=2,
                       norm_topk_prob=True, head_dim=32)),
}


def make_tiny_moe_model(tmp_path: Path, family: str = "mixtral", *, seed: int = 0, **extra) -> Path:
    """Save a 3-layer model of `family` (safetensors, per-expert names, no tokenizer) under tmp_path.

    Biases, norm weights, routers and the shared-expert gate are randomised too (routers with a
    wide spread, so routing is decisive), so a loader that drops or swaps one cannot pass."""
    config_cls, model_cls, fields = FAMILIES[family]
    config = config_cls(**{**COMMON, **fields, **extra})
    return save_random_model(model_cls, config, tmp_path, f"tiny-{family}", seed, init=INIT,
                             router_names=("mlp.gate.weight", "shared_expert_gate.weight"))


_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def to_fused_layout(path: Path) -> Path:
    """Rewrite a per-expert checkpoint in place into the fused expert tensors transformers keeps in memory
    (`model.layers.{i}.mlp.experts.gate_up_proj` gate rows then up rows, `...down_proj`)."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    out, experts = {}, {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        part = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(m[3], "down")
        experts.setdefault(m[1], {}).setdefault(part, {})[int(m[2])] = t
    for block, parts in experts.items():
        n = len(parts["down"])
        out[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)]).contiguous()
        out[f"{block}.experts.down_proj"] = torch.stack([parts["down"][e] for e in range(n)]).contiguous()
    save_file(out, file, metadata={"format": "pt"})
    return path
