"""Tensor-parallel linear layers: column, merged column (gate/up), QKV and row parallel.

Each parameter carries a `weight_loader` that copies this rank's slice of a
checkpoint tensor into it, so fused layouts (qkv, gate_up) and sharding are
handled where the layout is defined.

Prepacked weights (CPU decode programs): `pack_linear_weights` gives each layer a copy of its
weight in MKL's packed GEMM layout as a buffer; while `packed_weights_in_use()` is on (when a
static decode program is exported) the layers call the opaque `runner_core::packed_linear` op on
it. The packed buffer cannot move (MKL keeps address-dependent metadata in it), so it is a
program *input* made in this process, never a constant stored in a package.

Panels (CPU, float32 or bfloat16): `pack_panel_weights` gives each linear layer and the LM head a
`panel_weight` buffer, its weight as panels of 16 output columns, which `dense` multiplies with the
native kernel (runner_core/kernels, on this CPU's instruction-set tier) at every batch size, eager and
in compiled graphs (an opaque op to them). It is a copy made once after loading: `weight` stays the
parameter every other path reads.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear, panels_support
from runner_core.parallel.state import divide, get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce

PANEL_ROWS = 16  # output columns per panel (NR in kernels/tier.h)


def _check_shape(param_slice: torch.Tensor, loaded: torch.Tensor) -> None:
    if param_slice.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match expected {tuple(param_slice.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    _check_shape(param.data, loaded)
    param.data.copy_(loaded)


_PACKED_IN_USE: ContextVar[bool] = ContextVar("runner_core_packed_weights", default=False)


@contextmanager
def packed_weights_in_use() -> Iterator[None]:
    token = _PACKED_IN_USE.set(True)
    try:
        yield
    finally:
        _PACKED_IN_USE.reset(token)


@torch.library.custom_op("runner_core::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T through MKL's packed GEMM (`packed` from `torch.ops.mkl._mkl_reorder_linear_weight`)."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])


@packed_linear.register_fake
def _(x, packed, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


@functools.cache
def _packed_size(shape: tuple[int, int]) -> int:
    return torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(shape), 1).nbytes


def packed_bytes(shapes: Counter) -> int:
    """MKL's packed size of float32 weights of these [out, in] shapes (with counts), measured by
    packing one zero matrix of each shape (once per process): small matrices get a large minimum
    buffer."""
    return sum(count * _packed_size(tuple(shape)) for shape, count in shapes.items())


def packed_weight_bytes(model: nn.Module) -> int:
    """What `pack_linear_weights` will take for `model`."""
    return packed_bytes(Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, LinearBase)))


def pack_linear_weights(model: nn.Module, batch_size: int) -> int:
    """Give every linear layer a `packed_weight` buffer (MKL's layout, tuned for `batch_size` rows);
    returns the bytes they take."""
    total = 0
    for m in model.modules():
        if isinstance(m, LinearBase):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), batch_size)
            m.register_buffer("packed_weight", packed, persistent=False)
            total += packed.numel() * packed.element_size()
    return total


def unpack_linear_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, LinearBase) and "packed_weight" in m._buffers:
            del m._buffers["packed_weight"]


def panels_apply(device: torch.device | str, dtype: torch.dtype, world_size: int) -> bool:
    """Whether a runner with these settings gets panel copies of its weights: the CPU, one process,
    the native kernels built, float32 or bfloat16 (every kernel tier multiplies both)."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and world_size == 1 \
        and cpu_kernels_available() and panels_support(dtype)


def panel_bytes(shapes: Counter, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the panel copies of weights of these [out, in] shapes (with counts) in `dtype`: 16
    output columns per panel; bfloat16 panels hold k in pairs."""
    size = torch.empty((), dtype=dtype).element_size()
    pair = 2 if dtype == torch.bfloat16 else 1
    return sum(count * -(-n // PANEL_ROWS) * PANEL_ROWS * -(-k // pair) * pair * size
               for (n, k), count in shapes.items())


def pack_panel_weights(model: nn.Module) -> int:
    """Give every module with a `uses_panels` flag (linear layers, the LM head) a `panel_weight`
    buffer; returns the bytes they take."""
    total = 0
    for m in model.modules():
        if getattr(m, "uses_panels", False):
            panels = pack_panels(m.weight.detach())
            m.register_buffer("panel_weight", panels, persistent=False)
            total += panels.numel() * panels.element_size()
    return total


def dense(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b: through `module`'s panel copy of W when it has one, else F.linear."""
    panels = module._buffers.get("panel_weight")
    if panels is None or x.dtype != panels.dtype:
        return F.linear(x, weight, bias)
    y = panel_linear(x.reshape(-1, x.shape[-1]), panels, weight.shape[0], bias)
    return y.view(*x.shape[:-1], weight.shape[0])


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's [out, in] slice of W."""

    uses_panels = True  # pack_panel_weights gives it a panel copy

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # (dynamo cannot trace a ContextVar; its graphs never use the packed weights)
        if "packed_weight" in self._buffers and not torch.compiler.is_dynamo_compiling() and _PACKED_IN_USE.get():
            y = packed_linear(x, self._buffers["packed_weight"], self.weight)
            return y if bias is None else y + bias
        return dense(self, x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"), bias)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return tp_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored in one matrix (e.g. gate_proj and up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        default_weight_loader(param.narrow(0, offset, shard), loaded.narrow(0, self.tp_rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads split across ranks, KV heads replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, num_kv_heads, "tensor parallel size over num_key_value_heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q = self.num_heads * self.head_size
        kv = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, rank = 0, q, self.tp_rank
        else:
            offset = q if shard_id == "k" else q + kv
            size, rank = kv, self.tp_rank // self.kv_replicas
        default_weight_loader(param.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
