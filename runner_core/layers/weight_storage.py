"""One copy of each weight, in the form its matmul reads (vLLM's process_weights_after_loading).

The loader gives every layer that multiplies a weight (linear layers, the LM head: `uses_panels`) a
`WeightStorage` before the checkpoint streams in (`plan_storage`). As soon as a layer's weight is complete
(every fused shard loaded), `store_weight` turns it into its stored form and drops the row-major parameter,
so the model is never held twice and a quantized model never exists in full precision:

- "panels": the compute dtype, packed into the native CPU kernels' panels (`panel_weight` buffer);
- "quant-panels": int8 / int4 (layers/quantization.py) in the kernels' own layout (`q_*` buffers);
- "quant-rows": int8 / int4 row-major, dequantized one layer at a time at each call (no native kernels:
  several processes, CUDA, RUNNER_CORE_NO_KERNELS); the reference path, not a fast one;
- None: the row-major parameter, as loaded (a float weight where the panels do not apply).

A head tied to the embedding is stored like any head; the embedding then reads its rows from that one
copy (`embedding_rows`). `matmul` is the one place that multiplies a stored weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear, panels_support
from runner_core.layers import quantization as quant
from runner_core.layers.quantization import QuantFormat

logger = logging.getLogger("runner_core")
PANEL_ROWS = 16  # output columns per panel (NR in kernels/tier.h)


@dataclass(frozen=True)
class WeightStorage:
    """How one layer holds its weight after loading."""

    dtype: torch.dtype  # the compute dtype
    fmt: QuantFormat | None  # the storage format, or None for the compute dtype
    panels: bool  # the native CPU kernels' layout (else row-major)

    @property
    def kind(self) -> str | None:
        if self.fmt is not None:
            return "quant-panels" if self.panels else "quant-rows"
        return "panels" if self.panels else None


def panels_apply(device: torch.device | str, dtype: torch.dtype, world_size: int) -> bool:
    """Whether a runner with these settings stores its weights in the native kernels' layout: the CPU, one
    process, the kernels built, float32 or bfloat16 (every kernel tier multiplies both)."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and world_size == 1 \
        and cpu_kernels_available() and panels_support(dtype)


def plan_storage(model: nn.Module, dtype: torch.dtype, panels: bool, fmt: QuantFormat | None,
                 quantize_lm_head: bool) -> dict[str, str]:
    """Give every layer that multiplies a weight its `WeightStorage`, before the checkpoint streams in;
    returns the layers kept in the compute dtype under a format, with why. A quantized layer's weight is
    staged in float32, so it is quantized from the checkpoint's own values (one layer at a time). A head
    tied to the embedding is stored when the embedding's tensor streams in, and the embedding then reads
    its rows from it; tied to a module that reads the weight itself (transformers' nn.Embedding), it keeps
    the shared row-major weight."""
    readers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if module._parameters.get("weight") is not None:
            readers.setdefault(id(module._parameters["weight"]), []).append(module)
    kept = {}
    for name, module in model.named_modules():
        if not getattr(module, "uses_panels", False):
            continue
        tied = [m for m in readers[id(module.weight)] if m is not module]
        if any(not hasattr(m, "rows_from") for m in tied):
            continue
        layer_fmt, why = fmt, None
        if fmt is not None:
            k = module.weight.shape[1]
            if getattr(module, "is_lm_head", False) and not quantize_lm_head:
                layer_fmt, why = None, "the LM head (quantize_lm_head=False)"
            elif getattr(module, "keep_dtype", None):
                layer_fmt, why = None, module.keep_dtype
            else:
                layer_fmt = layer_format(fmt, k)
                why = None if layer_fmt is not None else f"k={k} is a multiple of no int4 group"
        if why is not None:
            kept[name] = why
        module.storage = WeightStorage(dtype, layer_fmt, panels)
        if layer_fmt is not None:
            w = module.weight  # the untied LM head is the [vocab, hidden] view of a [hidden, vocab] tensor
            module.weight.data = (torch.empty(w.shape[1], w.shape[0], dtype=torch.float32).t()
                                  if not w.is_contiguous() else torch.empty(w.shape, dtype=torch.float32))
        if tied and module.storage.kind is not None:
            module.weight.weight_loader = _TiedLoader(module.weight.weight_loader, module, tied)
    return kept


class _TiedLoader:
    """The shared parameter's loader (the embedding's): the tensor goes straight into the head's stored
    form, and the embedding reads its rows from there."""

    def __init__(self, load, head: nn.Module, embeddings: list[nn.Module]):
        self.load, self.head, self.embeddings = load, head, embeddings

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, *shard) -> None:
        source = direct_source(self.head, param, loaded)
        if source is None:
            self.load(param, loaded, *shard)
        store_weight(self.head, source)
        for module in self.embeddings:
            module.rows_from = [self.head]
            module._parameters.pop("weight", None)


def direct_source(module: nn.Module, param: nn.Parameter, loaded) -> torch.Tensor | None:
    """`loaded` when it is the whole of `module`'s weight (one shard, one process), so the layer can be stored
    from it without copying it into the parameter first; else None."""
    storage = getattr(module, "storage", None)
    if storage is None or storage.kind is None or not isinstance(loaded, torch.Tensor):
        return None
    return loaded if tuple(loaded.shape) == tuple(param.shape) else None


def finish_storage(model: nn.Module) -> None:
    """Store any layer whose weight streaming left row-major (a safety net: every complete layer is stored
    as its last shard comes in)."""
    for module in model.modules():
        if "weight" in module._parameters and getattr(module, "storage", None) is not None:
            store_weight(module)


def panel_bytes(n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes of the compute-dtype panels of an [n, k] weight: 16 output columns per panel; bfloat16 panels
    hold k in pairs."""
    pair = 2 if dtype == torch.bfloat16 else 1
    return -(-n // PANEL_ROWS) * PANEL_ROWS * -(-k // pair) * pair * dtype.itemsize


def weight_bytes(n: int, k: int, dtype: torch.dtype, fmt: QuantFormat | None, panels: bool) -> int:
    """The exact bytes an [n, k] weight holds after loading, stored as `WeightStorage(dtype, fmt, panels)`."""
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


def store_weight(module: nn.Module, source: torch.Tensor | None = None) -> None:
    """Turn `module`'s complete weight (the row-major parameter, or `source`, the whole checkpoint tensor) into
    its stored form and drop the parameter (its bytes are freed at once: the loader's own references to the
    Parameter object see an empty tensor)."""
    storage: WeightStorage | None = getattr(module, "storage", None)
    if storage is None or storage.kind is None or "weight" not in module._parameters:
        return
    param = module._parameters["weight"]
    n, k = param.shape
    weight = (param if source is None else source).detach()
    with torch.no_grad():
        if storage.fmt is None:
            module.register_buffer("panel_weight", pack_panels(weight.to(storage.dtype)), persistent=False)
        else:
            tensors = quant.quantize(weight, storage.fmt)
            if storage.panels:
                tensors = quant.pack(tensors, storage.fmt, n, k)
            for name, tensor in tensors.items():
                module.register_buffer(f"q_{name}", tensor, persistent=False)
    module.weight_shape = (n, k)
    del module._parameters["weight"]
    param.data = torch.empty(0, dtype=param.dtype)


def quant_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A quantized layer's stored tensors by name (without the `q_` prefix)."""
    return {name[2:]: t for name, t in module._buffers.items() if name.startswith("q_")}


def matmul(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b over `module`'s weight as it is stored."""
    kind = module.storage.kind if getattr(module, "storage", None) is not None and "weight" not in module._parameters \
        else None
    if kind is None:
        return F.linear(x, module.weight, bias)
    n, k = module.weight_shape
    dtype = module.storage.dtype
    flat = x.reshape(-1, k).to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if kind == "panels":
        y = panel_linear(flat, module._buffers["panel_weight"], n, bias)
    elif kind == "quant-panels":
        y = quant.quant_linear(flat, quant_tensors(module), module.storage.fmt, n, bias)
    else:
        y = F.linear(flat, quant.dequantize(quant_tensors(module), module.storage.fmt, dtype), bias)
    return y.view(*x.shape[:-1], n)


def row_major_weight(module: nn.Module) -> torch.Tensor:
    """A weight stored as compute-dtype panels back as its [n, k] matrix (for saving)."""
    n, k = module.weight_shape
    panels = module._buffers["panel_weight"]
    count, steps, width = panels.shape
    pair = width // PANEL_ROWS  # k values per panel step
    cols = panels.view(count, steps, PANEL_ROWS, pair).permute(0, 2, 1, 3)
    return cols.reshape(count * PANEL_ROWS, steps * pair)[:n, :k]


def embedding_rows(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of `module`'s stored [vocab, hidden] weight (a tied head read as the embedding), in the
    compute dtype, gathered from the one copy."""
    n, k = module.weight_shape
    kind, dtype = module.storage.kind, module.storage.dtype
    flat = ids.reshape(-1)
    if kind == "panels":
        panels = module._buffers["panel_weight"]
        pair = panels.shape[2] // PANEL_ROWS  # k values per panel step
        cols = panels.view(panels.shape[0], panels.shape[1], PANEL_ROWS, pair)
        rows = cols[flat // PANEL_ROWS, :, flat % PANEL_ROWS, :].reshape(flat.shape[0], -1)[:, :k]
    elif kind == "quant-panels":
        rows = quant.dequantize_rows(quant_tensors(module), module.storage.fmt, flat, k, dtype)
    else:
        tensors = {name: t[flat] for name, t in quant_tensors(module).items()}
        rows = quant.dequantize(tensors, module.storage.fmt, dtype)
    return rows.view(*ids.shape, k)


def num_weights(model: nn.Module) -> int:
    """The model's parameter count: its parameters and the weights stored in another form (tied ones once)."""
    return sum(p.numel() for p in model.parameters()) + sum(
        m.weight_shape[0] * m.weight_shape[1] for m in model.modules() if hasattr(m, "weight_shape"))


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the stored weights (panel and quantized buffers) of `model`."""
    return sum(t.numel() * t.element_size() for m in model.modules() for name, t in m._buffers.items()
               if t is not None and (name == "panel_weight" or name.startswith("q_")))
