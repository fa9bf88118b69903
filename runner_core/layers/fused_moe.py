"""Fused mixture-of-experts: routing and every expert over the flat token batch in one call.

`fused_moe(hidden [N, H], router_logits [N, E], w13 [E, 2I, H], w2 [E, H, I], top_k, renormalize)`:
softmax over the experts in float32, top-k, optional renormalisation (Mixtral always; Qwen-MoE
with `norm_topk_prob`); the N x k (token, expert) pairs are sorted by expert, each expert runs one
matmul pair (gate|up, SiLU-and-mul, down) over its contiguous slice of the gathered tokens, and
the results are weighted and summed back into token order with one `index_add_` — no loop over
tokens. Two ways to run the experts: "loop" (one `F.linear` pair per expert with tokens, the
default) and "grouped_mm" (`torch._grouped_mm` over the expert offsets); docs/benchmarks.md ("Models")
has the measurement that chose the default.

Under torch.compile the whole of it is one custom op (`runner_core::fused_moe`), like paged
attention: no graph break per expert, and its Python kernel (which reports the layer's routing to
an open record, layers/moe_record.py) runs in eager, compiled and AOTInductor programs alike.

`FusedMoE` holds one layer's experts as two stacked tensors, sharded for tensor parallelism
(gate and up split by columns, down by rows: the caller all-reduces once), and loads both
checkpoint layouts: per-expert tensors (`experts.{e}.w1|w3|w2` or `gate_proj|up_proj|down_proj`)
and fused ones (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from runner_core.distributed.parallel_state import divide, get_tp_rank, get_tp_size
from runner_core.layers.linear import default_weight_loader
from runner_core.layers.moe_record import current_record

EXPERTS_IMPLS = ("loop", "grouped_mm")
# how the experts run: "loop" unless RUNNER_CORE_MOE_IMPL says otherwise (benchmarks/models.py compares them)
EXPERTS_IMPL = os.environ.get("RUNNER_CORE_MOE_IMPL", "loop")
if EXPERTS_IMPL not in EXPERTS_IMPLS:
    raise ValueError(f"RUNNER_CORE_MOE_IMPL={EXPERTS_IMPL!r} is not one of {', '.join(EXPERTS_IMPLS)}")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] float32, expert ids [N, k]) as transformers routes: softmax in float32, top-k,
    renormalised to sum to 1 when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{id[t, k]}(hidden[t]) for every token t: [N, H] (`impl`: one of
    EXPERTS_IMPLS, default EXPERTS_IMPL)."""
    impl = impl or EXPERTS_IMPL
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
    token = order // top_k
    xs = hidden.index_select(0, token)  # [N*k, H]
    counts = torch.bincount(flat, minlength=num_experts)
    if impl == "grouped_mm":
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        act = _silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets))
        out = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)
    else:
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):  # one matmul pair per expert that has tokens
            if n:
                out[start:start + n] = F.linear(_silu_and_mul(F.linear(xs[start:start + n], w13[e])), w2[e])
                start += n
    weighted = (out * topk_weights.reshape(-1)[order].unsqueeze(1)).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, weighted)


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """Route and run the experts (this rank's shard of them: the result is a partial sum under TP);
    reports the routing to the open record, if any."""
    weights, ids = route(router_logits, top_k, renormalize)
    record = current_record()
    if record is not None:
        record.add(router_logits, ids, w13.shape[0])
    return fused_experts(hidden, w13, w2, weights, ids)


@torch.library.custom_op("runner_core::fused_moe", mutates_args=())
def fused_moe_op(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                 renormalize: bool) -> torch.Tensor:
    """`fused_moe` as one opaque op, so a compiled graph neither traces nor breaks on it."""
    return fused_moe(hidden, router_logits, w13, w2, top_k, renormalize)


@fused_moe_op.register_fake
def _(hidden, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(hidden)


class FusedMoE(nn.Module):
    """One layer's experts: `gate_up_proj` [E, 2I/tp, H] (gate rows, then up rows) and `down_proj`
    [E, H, I/tp]. forward(hidden, router_logits) -> this rank's partial sum [N, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.local_size = divide(intermediate_size, self.tp_size, "moe intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.local_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        fn = fused_moe_op if torch.compiler.is_compiling() else fused_moe
        return fn(hidden, router_logits, self.gate_up_proj, self.down_proj, self.top_k, self.renormalize)

    # ---- loading: which part of which expert a checkpoint tensor is, on this rank ---------------
    def load_expert(self, part: str, expert: int, loaded: torch.Tensor) -> None:
        """One expert's tensor: part "gate" or "up" ([I, H]) or "down" ([H, I])."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} does not exist: the config has {self.num_experts} experts")
        i, rank = self.local_size, self.tp_rank
        if part == "down":
            default_weight_loader(self._slice(self.down_proj, expert), loaded.narrow(1, rank * i, i))
        else:
            offset = 0 if part == "gate" else i
            target = self._slice(self.gate_up_proj, expert).narrow(0, offset, i)
            default_weight_loader(target, loaded.narrow(0, rank * i, i))

    def load_fused(self, part: str, loaded: torch.Tensor) -> None:
        """All experts at once: part "gate_up" ([E, 2I, H], gate rows then up rows) or "down" ([E, H, I])."""
        i, rank, full = self.local_size, self.tp_rank, self.intermediate_size
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"fused experts tensor of shape {tuple(loaded.shape)} does not hold "
                             f"{self.num_experts} experts as [experts, ...]")
        if part == "down":
            default_weight_loader(self.down_proj, loaded.narrow(2, rank * i, i))
            return
        if loaded.shape[1] != 2 * full:
            raise ValueError(f"fused gate_up_proj of shape {tuple(loaded.shape)} should be "
                             f"[{self.num_experts}, {2 * full}, hidden]: gate and up rows of {full} each")
        default_weight_loader(self.gate_up_proj.data.narrow(1, 0, i), loaded.narrow(1, rank * i, i))
        default_weight_loader(self.gate_up_proj.data.narrow(1, i, i), loaded.narrow(1, full + rank * i, i))

    @staticmethod
    def _slice(param: nn.Parameter, expert: int) -> torch.Tensor:
        return param.data[expert]
