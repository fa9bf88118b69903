"""Tensor-parallel linear layers: column, merged column (gate/up), QKV and row parallel.

Each parameter carries a `weight_loader` that copies this rank's slice of a
checkpoint tensor into it, so fused layouts (qkv, gate_up) and sharding are
handled where the layout is defined.

Each layer is a `WeightLayer` (weight_storage.py): its `storage` holds the weight once, in the form its
matmul reads (the native kernels' panels, int8/int4, or the row-major parameter), and multiplies it; the
weight is stored as soon as its last fused shard is in.

Prepacked weights (CPU decode programs, only where the weights stay row-major: the kernels off):
`pack_linear_weights` turns each layer's row-major storage into an `MKLPackedWeight`, which also holds the
weight in MKL's packed GEMM layout; while `packed_weights_in_use()` is on (when a static decode program is
exported) it calls the opaque `runner_core::packed_linear` op on that copy. The packed buffer cannot move (MKL
keeps address-dependent metadata in it), so it is a program *input* made in this process, never a constant
stored in a package.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from runner_core.distributed.parallel_state import divide, get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from runner_core.layers.weight_storage import RowMajorWeight, WeightLayer


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


class MKLPackedWeight(RowMajorWeight):
    """The row-major parameter and MKL's packed copy of it (`packed`, tuned for `batch_size` rows), which it
    multiplies inside `packed_weights_in_use` (a decode program's export); elsewhere it is a RowMajorWeight."""

    def __init__(self, weight: nn.Parameter, batch_size: int):
        super().__init__(weight)
        self.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), batch_size),
                             persistent=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # (dynamo cannot trace a ContextVar; its graphs never use the packed copy)
        if not torch.compiler.is_dynamo_compiling() and _PACKED_IN_USE.get():
            y = packed_linear(x, self.packed, self.weight)
            return y if bias is None else y + bias
        return super().matmul(x, bias)


@functools.cache
def _packed_size(shape: tuple[int, int]) -> int:
    return torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(shape), 1).nbytes


def packed_bytes(shapes: Counter) -> int:
    """MKL's packed size of float32 weights of these [out, in] shapes (with counts), measured by
    packing one zero matrix of each shape (once per process): small matrices get a large minimum
    buffer."""
    return sum(count * _packed_size(tuple(shape)) for shape, count in shapes.items())


def _row_major_linears(model: nn.Module) -> list[LinearBase]:
    """The linear layers whose weight stays row-major (stored ones have no second copy to pack)."""
    return [m for m in model.modules() if isinstance(m, LinearBase) and m.storage.kind is None]


def packed_weight_bytes(model: nn.Module) -> int:
    """What `pack_linear_weights` will take for `model`."""
    return packed_bytes(Counter(m.storage.shape for m in _row_major_linears(model)))


def pack_linear_weights(model: nn.Module, batch_size: int) -> int:
    """Give every linear layer whose weight stays row-major MKL's packed copy of it (tuned for `batch_size`
    rows); returns the bytes the copies take. Layers stored as panels or quantized keep their one copy: a
    program multiplies that."""
    return sum(m.pack_weight(batch_size) for m in _row_major_linears(model))


def unpack_linear_weights(model: nn.Module) -> None:
    for m in _row_major_linears(model):
        m.unpack_weight()


class LinearBase(WeightLayer):
    """y = x W^T + b over this rank's [out, in] slice of W, held and multiplied by its `storage`."""

    multiplies = True

    def __init__(self, in_features: int, out_features: int, bias: bool, keep_dtype: str | None = None):
        """`keep_dtype`: why this weight stays in the compute dtype when the model is quantized (a router's)."""
        super().__init__()
        self.keep_dtype = keep_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.storage.matmul(x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.storage.matmul(x, self.bias)

    def pack_weight(self, batch_size: int) -> int:
        """Its row-major weight with MKL's packed copy beside it (`MKLPackedWeight`); the copy's bytes."""
        self.storage = MKLPackedWeight(self.weight, batch_size)
        return self.storage.packed.nbytes

    def unpack_weight(self) -> None:
        """Drop MKL's packed copy, if any."""
        if isinstance(self.storage, MKLPackedWeight):
            self.storage = RowMajorWeight(self.weight)


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
        self.num_shards = len(output_sizes)

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
        self.num_shards = 3  # q, k, v

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
