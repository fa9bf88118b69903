"""One object per layer holds its weight, once, in the form its matmul reads (vLLM's per-layer `quant_method`
with `process_weights_after_loading`; here the object also holds the tensors).

A layer with a weight (linear layers, the vocabulary embedding, the LM head) is a `WeightLayer`; its `storage`
is a `WeightStorage`, a child module that alone holds and reads the weight's tensors: `store(tensor)`,
`matmul(x, bias)`, `embedding(ids)` (rows), `row_major()` (for saving) and `nbytes`. The kinds:

- `RowMajorWeight` (kind None): the layer's row-major parameter itself, as loaded (several processes, CUDA, the
  kernels off); for CPU decode programs a linear layer's may become an `MKLPackedWeight` (layers/linear.py);
- `PanelWeight` ("panels"): the compute dtype in the native kernels' 16-column panels;
- `QuantPanelWeight` ("quant-panels"): int8 / int4 (layers/quantization.py) in the kernels' own layout;
- `QuantRowWeight` ("quant-rows"): int8 / int4 row-major, dequantized at each call (no native kernels); the
  reference path, not a fast one.

Loading: before the checkpoint streams in, the loader gives each layer that multiplies a weight its storage
(`plan_storage`). The weight streams into the layer's row-major parameter (`weight`, under the checkpoint's
name, with its `weight_loader`); as soon as it is complete (every fused shard in; a one-shard weight straight
from the checkpoint tensor) the layer hands it to `storage.store` and drops the parameter
(`WeightLayer.store_weight`), so the model is never held twice and a quantized model never exists in full
precision. `finish_storage` stores what streaming left. A head tied to the embedding is stored when the
embedding's tensor streams in; the embedding then shares the head's storage and reads its rows from that copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner_core.kernels import (
    PANEL_COLUMNS,
    cpu_kernels_available,
    pack_panels,
    panel_linear,
    panels_shape,
    panels_support,
    quant_linear,
)
from runner_core.layers import quantization as quant
from runner_core.layers.quantization import QuantFormat


class WeightStorage(nn.Module):
    """How one layer holds its [n, k] weight once it is loaded. A kind defines `_convert` (the weight -> its
    tensors, set as buffers), `_linear` (flat x [m, k] -> [m, n]), `_rows` (flat ids -> [len, k]) and
    `row_major`."""

    kind: str | None = None
    fmt: QuantFormat | None = None  # the storage format, or None for the compute dtype
    stored = False  # whether `store` has taken the weight in

    def __init__(self, n: int, k: int, dtype: torch.dtype):
        super().__init__()
        self.n, self.k, self.dtype = n, k, dtype  # dtype: the compute dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """The bytes it holds."""
        return sum(t.nbytes for t in self.buffers())

    def store(self, weight: torch.Tensor) -> None:
        """Take the complete [n, k] weight in, in the stored form (vLLM's process_weights_after_loading)."""
        with torch.no_grad():
            for name, tensor in self._convert(weight.detach()).items():
                setattr(self, name, tensor)
        self.stored = True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b (vLLM's apply), over any leading shape of x, in the compute dtype. (A flat batch in the
        compute dtype, the common case, goes straight to the kernel: each reshape, view or cast of a tensor
        costs about a microsecond of dispatch, times every layer of every step.)"""
        flat = x if x.dim() == 2 else x.reshape(-1, self.k)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        y = self._linear(flat, bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.n)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the compute dtype (a tied head read as the embedding): only those rows."""
        return self._rows(ids.reshape(-1)).view(*ids.shape, self.k)

    def row_major(self) -> dict[str, torch.Tensor]:
        """The weight as a checkpoint holds it: {"weight": [n, k]}, or a format's row-major tensors."""
        raise NotImplementedError

    def _tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers(recurse=False))


class RowMajorWeight(WeightStorage):
    """The layer's row-major parameter itself (the layer's `weight`, where the checkpoint's names find it),
    multiplied by F.linear."""

    stored = True

    def __init__(self, weight: nn.Parameter):
        nn.Module.__init__(self)
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def store(self, weight: torch.Tensor) -> None:
        """Nothing to do: the parameter, loaded, is the stored form."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def row_major(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}


class PanelWeight(WeightStorage):
    """The compute dtype in the native kernels' panels of PANEL_COLUMNS output columns (`panel_linear`)."""

    kind = "panels"

    def __init__(self, n: int, k: int, dtype: torch.dtype):
        super().__init__(n, k, dtype)
        self.register_buffer("panels", None, persistent=False)

    def _convert(self, weight):
        return quant.by_row_chunks(weight, panels_shape(self.n, self.k, self.dtype)[0],
                                   lambda rows: {"panels": pack_panels(rows.to(self.dtype))})

    def _linear(self, flat, bias):
        return panel_linear(flat, self.panels, self.n, bias)

    def _columns(self) -> torch.Tensor:
        """The panels as [panel, k step, column, k values per step]."""
        count, steps, width = self.panels.shape
        return self.panels.view(count, steps, PANEL_COLUMNS, width // PANEL_COLUMNS)

    def _rows(self, ids):
        return self._columns()[ids // PANEL_COLUMNS, :, ids % PANEL_COLUMNS, :].reshape(ids.shape[0], -1)[:, :self.k]

    def row_major(self):
        cols = self._columns()
        count, steps, _, pair = cols.shape
        return {"weight": cols.permute(0, 2, 1, 3).reshape(count * PANEL_COLUMNS, steps * pair)[:self.n, :self.k]}


class _Quantized(WeightStorage):
    """int8 / int4 (layers/quantization.py): its tensors `_names` (int8 has no mins)."""

    _names = ("qweight", "scales", "mins")

    def __init__(self, n: int, k: int, dtype: torch.dtype, fmt: QuantFormat):
        super().__init__(n, k, dtype)
        self.fmt = fmt
        for name in self._names:
            self.register_buffer(name, None, persistent=False)



class QuantPanelWeight(_Quantized):
    """int8 / int4 in the kernels' panel layout (quantization.pack), multiplied by `quant_linear`, which
    dequantizes in registers: no float copy of the weight is ever made."""

    kind = "quant-panels"
    _names = ("qpanels", "scales", "mins")

    def _convert(self, weight):
        return quant.quantize_packed(weight, self.fmt)

    def _linear(self, flat, bias):
        return quant_linear(flat, self.qpanels, self.scales, self.mins, self.n, self.fmt.group, bias)

    def _rows(self, ids):
        return quant.dequantize_rows(self._tensors(), self.fmt, ids, self.k, self.dtype)

    def row_major(self):
        return quant.unpack(self._tensors(), self.fmt, self.n, self.k)


class QuantRowWeight(_Quantized):
    """int8 / int4 row-major, the whole layer dequantized at each call (the reference path: no native kernels)."""

    kind = "quant-rows"

    def _convert(self, weight):
        return quant.quantize(weight, self.fmt)

    def _linear(self, flat, bias):
        return F.linear(flat, quant.dequantize(self._tensors(), self.fmt, self.dtype), bias)

    def _rows(self, ids):
        return quant.dequantize({name: t[ids] for name, t in self._tensors().items()}, self.fmt, self.dtype)

    def row_major(self):
        return self._tensors()


class WeightLayer(nn.Module):
    """A layer whose weight a `WeightStorage` holds (`storage`). Assigning a Parameter to `weight` (at
    construction, or a model tying its head to the embedding) gives it a `RowMajorWeight` of that parameter;
    the loader may plan another kind (`plan_storage`), which the weight goes into once loaded."""

    multiplies = False  # True: the loader plans its storage (linear layers, the LM head; an embedding only reads)
    num_shards = 1  # checkpoint tensors that make up the weight
    is_lm_head = False  # stored in the compute dtype unless quantize_lm_head (the head sets it)
    keep_dtype: str | None = None  # why the weight stays in the compute dtype under int8/int4, if it must

    def __init__(self):
        super().__init__()
        self.shards_loaded: set = set()

    def __setattr__(self, name, value) -> None:
        if name == "weight" and isinstance(value, nn.Parameter):
            super().__setattr__(name, value)
            name, value = "storage", RowMajorWeight(value)
        super().__setattr__(name, value)
        if name == "storage":  # a child module (what torch walks), also found without Module.__getattr__: every
            self.__dict__[name] = value  # matmul reads it (about a microsecond saved per layer per step)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """The weight's loader: this shard in, and the weight stored once its last shard is (a weight of one
        shard straight from the checkpoint tensor, never copied into the parameter)."""
        if self.num_shards == 1 and _whole(self.storage, param, loaded):
            self.store_weight(loaded)
            return
        self.weight_loader(param, loaded, *shard_id)
        self.shards_loaded.add(shard_id)
        if len(self.shards_loaded) == self.num_shards:
            self.store_weight()

    def store_weight(self, source: torch.Tensor | None = None) -> None:
        """Hand the complete weight (the parameter, or `source`, the whole checkpoint tensor) to `storage` and
        drop the parameter (its bytes are freed at once: the loader's references to it see an empty tensor).
        The stored form is made on the parameter's device, the model's: a checkpoint tensor is moved there first
        (on CUDA the quantizer runs on the GPU, and the model's matmuls find their weights beside them)."""
        if self.storage.stored:
            return
        param = self.weight
        self.storage.store(param if source is None else source.to(param.device))
        del self.weight
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def use_storage(self, storage: WeightStorage) -> None:
        """Hold the weight in `storage` once it is loaded. A quantized one is staged in float32 on the model's
        device, so it is quantized from the checkpoint's own values (the untied LM head's parameter is the
        [vocab, hidden] view of a [hidden, vocab] tensor, and keeps that layout)."""
        self.storage = storage
        if storage.fmt is not None:
            w = self.weight
            kw = {"dtype": torch.float32, "device": w.device}
            self.weight.data = torch.empty(w.shape[1], w.shape[0], **kw).t() if not w.is_contiguous() \
                else torch.empty(w.shape, **kw)

    def share_storage(self, head: WeightLayer) -> None:
        """Read this layer's weight from `head`'s storage (an embedding tied to the head: rows from one copy). The
        storage stays the head's submodule alone: under two names its tensors would reach an exported program
        twice, and AOTInductor's package then reads a tensor it was never given (a compiled tied model failed)."""
        if "weight" in dict(self.named_parameters(recurse=False)):
            del self.weight
        del self.storage
        self.__dict__["storage"] = head.storage


def _whole(storage: WeightStorage, param: nn.Parameter, loaded) -> bool:
    """Whether `loaded` is the whole of a weight stored in another form (one shard, one process)."""
    return storage.kind is not None and isinstance(loaded, torch.Tensor) and loaded.shape == param.shape


def panels_apply(device: torch.device | str, dtype: torch.dtype, world_size: int) -> bool:
    """Whether a runner with these settings stores its weights in the native kernels' layout: the CPU, one
    process, the kernels built, float32 or bfloat16 (every kernel tier multiplies both)."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and world_size == 1 \
        and cpu_kernels_available() and panels_support(dtype)


def make_storage(n: int, k: int, dtype: torch.dtype, fmt: QuantFormat | None, panels: bool) -> WeightStorage | None:
    """The storage of an [n, k] weight in `fmt` (None: the compute dtype), in the kernels' layout or not; None
    where it stays the row-major parameter."""
    if fmt is not None:
        return (QuantPanelWeight if panels else QuantRowWeight)(n, k, dtype, fmt)
    return PanelWeight(n, k, dtype) if panels else None


def plan_storage(model: nn.Module, dtype: torch.dtype, panels: bool, fmt: QuantFormat | None,
                 quantize_lm_head: bool) -> dict[str, str]:
    """Give every layer that multiplies a weight its storage, before the checkpoint streams in; returns the
    layers kept in the compute dtype under a format, with why. A head tied to the embedding is stored when the
    embedding's tensor streams in; tied to a module that reads the weight itself (transformers' nn.Embedding),
    it keeps the shared row-major weight."""
    readers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if not isinstance(module, WeightStorage):
            for p in module.parameters(recurse=False):
                readers.setdefault(id(p), []).append(module)
    kept = {}
    for name, module in model.named_modules():
        if not (isinstance(module, WeightLayer) and module.multiplies):
            continue
        tied = [m for m in readers[id(module.weight)] if m is not module]
        if any(not isinstance(m, WeightLayer) for m in tied):
            continue
        n, k = module.weight.shape
        layer_fmt, why = fmt, None
        if fmt is not None:
            if module.is_lm_head and not quantize_lm_head:
                layer_fmt, why = None, "the LM head (quantize_lm_head=False)"
            elif module.keep_dtype:
                layer_fmt, why = None, module.keep_dtype
            else:
                layer_fmt = layer_format(fmt, k)
                why = None if layer_fmt is not None else f"k={k} is a multiple of no int4 group"
        if why is not None:
            kept[name] = why
        storage = make_storage(n, k, dtype, layer_fmt, panels)
        if storage is not None:
            module.use_storage(storage)
            if tied:
                module.weight.weight_loader = _TiedLoader(module.weight.weight_loader, module, tied)
    return kept


class _TiedLoader:
    """The shared parameter's loader (the embedding's): the tensor goes straight into the head's stored
    form, and the embedding shares the head's storage."""

    def __init__(self, load, head: WeightLayer, embeddings: list[WeightLayer]):
        self.load, self.head, self.embeddings = load, head, embeddings

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, *shard) -> None:
        whole = _whole(self.head.storage, param, loaded)
        if not whole:
            self.load(param, loaded, *shard)
        self.head.store_weight(loaded if whole else None)
        for module in self.embeddings:
            module.share_storage(self.head)


def finish_storage(model: nn.Module) -> None:
    """Store any layer whose weight streaming left row-major (a safety net: every complete layer is stored
    as its last shard comes in)."""
    for module in model.modules():
        if isinstance(module, WeightLayer) and module.multiplies and not module.storage.stored:
            module.store_weight()


def stored_storages(model: nn.Module) -> list[WeightStorage]:
    """The storages holding a weight in another form than a parameter (a shared one once)."""
    return [m for m in model.modules() if isinstance(m, WeightStorage) and m.kind is not None and m.stored]


def num_weights(model: nn.Module) -> int:
    """The model's parameter count: its parameters and the weights stored in another form (tied ones once)."""
    return sum(p.numel() for p in model.parameters()) + sum(s.n * s.k for s in stored_storages(model))


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the weights stored in another form than a parameter (panels, quantized tensors) of `model`."""
    return sum(s.nbytes for s in stored_storages(model))


def panel_bytes(n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes of the compute-dtype panels of an [n, k] weight."""
    return math.prod(panels_shape(n, k, dtype)) * dtype.itemsize


def weight_bytes(n: int, k: int, dtype: torch.dtype, fmt: QuantFormat | None, panels: bool) -> int:
    """The exact bytes an [n, k] weight holds after loading, stored as `make_storage(n, k, dtype, fmt, panels)`."""
    if fmt is not None:
        return quant.packed_bytes(n, k, fmt) if panels else fmt.stored_bytes(n, k)
    return panel_bytes(n, k, dtype) if panels else n * k * dtype.itemsize


def layer_format(fmt: QuantFormat, k: int) -> QuantFormat | None:
    """The format a layer of input size `k` is stored in: `fmt`, or an int4 group below it that divides
    k (k=352 takes groups of 32 when 64 was asked), or None (the compute dtype) when none does."""
    if fmt.check(1, k) is None:
        return fmt
    smaller = [g for g in (64, 32) if g < fmt.group and k % g == 0]
    return QuantFormat.of("int4", smaller[0]) if smaller else None
