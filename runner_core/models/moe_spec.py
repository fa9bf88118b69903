"""MoESpec: what a mixture-of-experts config.json says about its experts, read in one place for
the models, the memory formulas (memory/shapes.py) and the parallel-layout checks.

Families (transformers 5.24 names):
  mixtral              `num_local_experts`, `num_experts_per_tok`, every layer sparse with
                       experts of `intermediate_size`; softmax -> top-k -> renormalise.
  qwen2_moe, qwen3_moe `num_experts`, `num_experts_per_tok`, experts of `moe_intermediate_size`;
                       layer i is sparse unless i is in `mlp_only_layers` or (i + 1) is not a
                       multiple of `decoder_sparse_step` (dense layers keep an MLP of
                       `intermediate_size`); renormalise only with `norm_topk_prob`. qwen2_moe
                       adds a sigmoid-gated shared expert of `shared_expert_intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    sparse_layers: tuple[int, ...]  # global indices of the decoder layers with experts
    renormalize: bool  # renormalise the top-k probabilities to sum to 1
    dense_intermediate_size: int  # the MLP width of the dense layers (if any)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    @classmethod
    def from_hf_config(cls, cfg) -> MoESpec | None:
        """The spec of an MoE config, None for a dense one. Raises ValueError naming a field that
        cannot describe a working MoE model."""
        model_type = getattr(cfg, "model_type", "")
        if model_type not in MOE_MODEL_TYPES:
            return None
        layers = cfg.num_hidden_layers
        if model_type == "mixtral":
            experts, width, sparse = cfg.num_local_experts, cfg.intermediate_size, tuple(range(layers))
            renormalize, shared = True, 0
        else:
            experts, width = cfg.num_experts, cfg.moe_intermediate_size
            step = getattr(cfg, "decoder_sparse_step", 1)
            if not isinstance(step, int) or step < 1:
                raise ValueError(f"decoder_sparse_step={step!r} must be an int >= 1 (every step-th layer has "
                                 "experts); fix config.json")
            dense = set(getattr(cfg, "mlp_only_layers", None) or ())
            sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
            renormalize = bool(getattr(cfg, "norm_topk_prob", False))
            shared = getattr(cfg, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        top_k = cfg.num_experts_per_tok
        if sparse and not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts "
                             f"({experts}); fix config.json")
        return cls(num_experts=experts, top_k=top_k, intermediate_size=width, sparse_layers=sparse,
                   renormalize=renormalize, dense_intermediate_size=cfg.intermediate_size,
                   shared_expert_intermediate_size=shared or 0)

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index in self.sparse_layers
