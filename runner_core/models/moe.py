"""What the MoE families (mixtral.py, qwen_moe.py) share: the sparse block that replaces a decoder
layer's MLP, and `MoEForCausalLM`, the Llama-family model with MoE layers and the expert names of
both checkpoint layouts.

The block: a replicated router (`gate`, [E, H]), the experts (`layers.fused_moe.FusedMoE`, sharded
under tensor parallelism) and optionally a sigmoid-gated shared expert (Qwen2-MoE); the experts'
and the shared expert's partial sums are added before the block's one all-reduce.

Checkpoint names (transformers 5.24 `save_pretrained` writes the per-expert ones):
  Mixtral      model.layers.{i}.block_sparse_moe.gate.weight, ...experts.{e}.w1|w3|w2.weight
  Qwen-MoE     model.layers.{i}.mlp.gate.weight, ...mlp.experts.{e}.gate_proj|up_proj|down_proj.weight
  fused        model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H], ...mlp.experts.down_proj [E, H, I]
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from runner_core.distributed.parallel_state import tp_all_reduce
from runner_core.layers.activation import SiluAndMul
from runner_core.layers.fused_moe import FusedMoE
from runner_core.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from runner_core.layers.moe_record import RoutingRecord, gather_layers
from runner_core.models.llama import LlamaForCausalLM
from runner_core.models.moe_spec import MoESpec

_EXPERT_NAME = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?:(?P<expert>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|"
                          r"down_proj)\.weight|(?P<fused>gate_up_proj|down_proj))$")
_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class SharedExpert(nn.Module):
    """A gated MLP whose down projection is left unreduced: the block adds it to the experts' partial
    sum before its one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self.act_fn(self.gate_up_proj(x)), None)


# why the routers stay in the compute dtype under int8/int4 (weight_storage.plan_storage): a near tie between two
# experts' scores turns on a rounding, and they are a sliver of the weights
ROUTER_KEEPS_DTYPE = "an MoE router (its scores pick the experts)"


class SparseMoeBlock(nn.Module):
    """Router, experts and optional sigmoid-gated shared expert over the flat batch [N, H]."""

    def __init__(self, config, spec: MoESpec):
        super().__init__()
        h = config.hidden_size
        # the router, replicated on every rank
        self.gate = LinearBase(h, spec.num_experts, bias=False, keep_dtype=ROUTER_KEEPS_DTYPE)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, h, spec.intermediate_size, spec.renormalize)
        if spec.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(h, spec.shared_expert_intermediate_size)
            self.shared_expert_gate = LinearBase(h, 1, bias=False, keep_dtype=ROUTER_KEEPS_DTYPE)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return tp_all_reduce(out)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers (`moe_spec.sparse_layers`) carry a SparseMoeBlock.
    Beyond the model contract it exposes `moe_spec` and `moe_layers` (the global indices of the
    sparse layers this pipeline stage holds, in the order their routing is recorded)."""

    def __init__(self, config):
        self.moe_spec = MoESpec.from_hf_config(config)
        if self.moe_spec is None:
            raise ValueError(f"model_type {getattr(config, 'model_type', None)!r} is not a mixture-of-experts "
                             "config this runner reads (mixtral, qwen2_moe, qwen3_moe)")
        super().__init__(config)
        self.moe_layers = [i for i in range(self.model.start_layer, self.model.end_layer)
                           if self.moe_spec.is_sparse(i)]

    # ---- what a forward's routing record holds, for every MoE layer of the model ------------------
    def expert_counts(self, record: RoutingRecord) -> torch.Tensor | None:
        """Tokens routed to each expert: [len(moe_spec.sparse_layers), num_experts] int64 (every
        pipeline stage's layers, on every rank); None when this rank's experts did not report (a CUDA
        graph replay runs no Python; graphs are single-rank)."""
        if len(record.counts) != len(self.moe_layers):
            return None
        spec, device = self.moe_spec, self.model.layers[0].input_layernorm.weight.device
        return gather_layers(record.counts, self._global_rows(), len(spec.sparse_layers), (spec.num_experts,),
                             torch.int64, device)

    def router_logits(self, record: RoutingRecord, num_tokens: int) -> torch.Tensor:
        """Router logits of a forward opened with capture_logits: [MoE layers, num_tokens, num_experts]."""
        spec, w = self.moe_spec, self.model.layers[0].input_layernorm.weight
        return gather_layers(record.logits, self._global_rows(), len(spec.sparse_layers),
                             (num_tokens, spec.num_experts), w.dtype, w.device)

    def _global_rows(self) -> list[int]:
        return [self.moe_spec.sparse_layers.index(i) for i in self.moe_layers]

    def moe_block(self, config, layer_index: int) -> nn.Module | None:
        """The layer's sparse block, or None for a dense layer."""
        return SparseMoeBlock(config, self.moe_spec) if self.moe_spec.is_sparse(layer_index) else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors are loaded here (both layouts, every rank its shard); the rest goes through
        the Llama loader. An experts parameter counts as loaded once every expert's part is in."""
        params = dict(self.named_parameters())
        seen: dict[str, set] = {}

        def others():
            for ckpt_name, tensor in weights:
                name = ckpt_name.replace(".block_sparse_moe.", ".mlp.")
                m = _EXPERT_NAME.match(name)
                if m is None:
                    yield name, tensor
                    continue
                local = self._local_name(name)
                if local is None:
                    continue
                block = _EXPERT_NAME.match(local)["block"]
                experts = self.get_submodule(f"{block}.experts") if f"{block}.experts.down_proj" in params else None
                if experts is None:
                    raise ValueError(f"checkpoint tensor '{ckpt_name}' is an expert of a layer this config "
                                     "makes dense (mlp_only_layers / decoder_sparse_step)")
                tensor = tensor.to(experts.down_proj.dtype)
                try:
                    self._load_expert(experts, m, tensor, seen, f"{block}.experts")
                except ValueError as e:
                    raise ValueError(f"'{ckpt_name}': {e}") from None

        loaded = super().load_weights(others())
        for prefix, parts in seen.items():
            experts = self.get_submodule(prefix)
            need_up = {(e, p) for e in range(experts.num_experts) for p in ("gate", "up")}
            need_down = {(e, "down") for e in range(experts.num_experts)}
            if need_up <= parts:
                loaded.add(f"{prefix}.gate_up_proj")
            if need_down <= parts:
                loaded.add(f"{prefix}.down_proj")
        return loaded

    @staticmethod
    def _load_expert(experts: FusedMoE, m: re.Match, tensor, seen: dict[str, set], prefix: str) -> None:
        parts = seen.setdefault(prefix, set())
        everyone = range(experts.num_experts)
        if m["fused"] == "gate_up_proj":
            experts.load_fused("gate_up", tensor)
            parts.update((e, p) for e in everyone for p in ("gate", "up"))
        elif m["fused"] == "down_proj":
            experts.load_fused("down", tensor)
            parts.update((e, "down") for e in everyone)
        else:
            part, expert = _PARTS[m["part"]], int(m["expert"])
            experts.load_expert(part, expert, tensor)
            parts.add((expert, part))
