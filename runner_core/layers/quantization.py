"""Weight storage formats apart from the compute dtype: what int8 and int4 hold and how a float weight
becomes one (and back, for the reference path and for saving).

- int8: symmetric, one float32 scale per output channel: w[n, k] ~ scale[n] * q[n, k], q in [-127, 127].
- int4: asymmetric, groups of `group` weights along k, each with a float32 scale and minimum:
  w ~ scale[n, g] * q + min[n, g], q in [0, 15]. Asymmetric because a group of real (or random) weights
  is rarely centred on zero: a minimum lets all 16 levels span the group's own range, where a symmetric
  format would leave levels unused on the side the group does not reach (llama.cpp's Q4_1 against Q4_0).
  Row-major storage packs two k values per byte: the low nibble holds the even k, the high the odd one.

Row-major tensors (`quantize`) are what a checkpoint saved by this project holds. The layers hold one
copy, in the native kernels' panel layout (`pack`; runner_core/kernels/quant_tile.h multiplies it with no
dequantized copy): panels of 16 output columns, the last zero padded, P = ceil(n / 16) of them:
- int8: "qpanels" int8 [P, k, 16], "scales" float32 [P, 1, 16];
- int4: "qpanels" uint8 [P, k / 2, 16] (a byte is one column's k pair, low nibble the even k, as in the
  row-major form), "scales" and "mins" float32 [P, k / group, 16].
`unpack` gives the row-major tensors back, `dequantize_rows` a few rows in a float dtype (a tied,
quantized LM head gives the embedding its rows from the one copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner_core import kernels
from runner_core.kernels import PANEL_COLUMNS, cpu_kernels_available
from runner_core.process_memory import on_file_mapping, page_out

INT8_MAX = 127
INT4_LEVELS = 15


@dataclass(frozen=True)
class QuantFormat:
    """A storage format: "int8" (per output channel) or "int4" with `group` weights per scale along k."""

    name: str
    group: int = 0  # int4 only

    @classmethod
    def of(cls, name: str, group: int = 64) -> QuantFormat:
        if name not in ("int8", "int4"):
            raise ValueError(f"no quantization format {name!r}: use 'int8' or 'int4'")
        return cls(name, group if name == "int4" else 0)

    @property
    def bits(self) -> float:
        """Stored bits per weight, scales and minimums included, for large k."""
        return 8.0 if self.name == "int8" else 4.0 + 64 / self.group

    def describe(self) -> str:
        return "int8 (per-channel scales)" if self.name == "int8" else f"int4 (groups of {self.group})"

    def check(self, n: int, k: int) -> str | None:
        """Why an [n, k] weight cannot be stored in this format, or None when it can."""
        if self.name == "int4" and k % self.group:
            return f"k={k} is not a multiple of the int4 group size {self.group}"
        return None

    def stored_bytes(self, n: int, k: int) -> int:
        """Bytes of `quantize`'s row-major tensors of an [n, k] weight."""
        if self.name == "int8":
            return n * k + 4 * n
        return n * k // 2 + 8 * n * (k // self.group)


CHUNK_BYTES = 1 << 20  # a chunk's rows in float32 at most: its temporaries come from the heap, reused chunk after
#                        chunk, below the mmap threshold a load sets (process_memory.heap_gives_back)


def rows_per_chunk(k: int) -> int:
    """Rows of a [n, k] weight converted at a time: CHUNK_BYTES of float32, whole panels, at least one panel."""
    return max(PANEL_COLUMNS, CHUNK_BYTES // (4 * k) // PANEL_COLUMNS * PANEL_COLUMNS)


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """Row-major quantized tensors of an [n, k] float weight: {"qweight", "scales"} for int8 (int8 [n, k],
    float32 [n, 1]); {"qweight", "scales", "mins"} for int4 (uint8 [n, k / 2], float32 [n, k / group] twice)."""
    _check(weight, fmt)
    return by_row_chunks(weight, weight.shape[0], lambda rows: _quantize_rows(rows, fmt))


def quantize_packed(weight: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """`pack(quantize(weight))`, what a layer holds, made without either whole: neither the row-major copy nor a
    second one ever exists, only the packed tensors and one chunk's temporaries."""
    _check(weight, fmt)
    n, k = weight.shape
    return by_row_chunks(weight, -(-n // PANEL_COLUMNS),
                         lambda rows: pack(_quantize_rows(rows, fmt), fmt, rows.shape[0], k))


def by_row_chunks(weight: torch.Tensor, total: int, convert) -> dict[str, torch.Tensor]:
    """`convert` (rows -> {name: tensor}) over `rows_per_chunk` rows of `weight` at a time, each chunk's tensors
    written into tensors of `total` leading rows allocated once (int8 and int4 scales are per row; a chunk is
    whole panels): converting a layer holds its result and one chunk's temporaries, whatever its size, never a
    whole float32 copy of it; the mapped pages of a checkpoint tensor are dropped chunk by chunk once read."""
    out, at = {}, 0
    n, k = weight.shape
    step = rows_per_chunk(k)
    mapped = weight.is_contiguous() and on_file_mapping(weight)  # a checkpoint tensor: its pages dropped once read
    for i in range(0, n, step):
        rows = weight.narrow(0, i, min(step, n - i))
        part = convert(rows)
        if mapped:
            page_out(rows)
        if not out:
            out = {name: t.new_empty((total, *t.shape[1:])) for name, t in part.items()}
        for name, t in part.items():
            out[name][at:at + t.shape[0]].copy_(t)
        at += next(iter(part.values())).shape[0]
    return out


def _check(weight: torch.Tensor, fmt: QuantFormat) -> None:
    why = fmt.check(*weight.shape)
    if why is not None:
        raise ValueError(why)


def _quantize_rows(weight: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    w = weight.detach().float()
    if fmt.name == "int8":
        scales = w.abs().amax(dim=1, keepdim=True) / INT8_MAX
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(w / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return {"qweight": q, "scales": scales}
    n, k = w.shape
    groups = w.view(n, k // fmt.group, fmt.group)
    mins, maxs = groups.amin(dim=2), groups.amax(dim=2)
    scales = (maxs - mins) / INT4_LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - mins.unsqueeze(2)) / scales.unsqueeze(2)).clamp_(0, INT4_LEVELS).to(torch.uint8)
    q = q.view(n, k // 2, 2)
    return {"qweight": q[..., 0] | (q[..., 1] << 4), "scales": scales, "mins": mins}


def dequantize(tensors: dict[str, torch.Tensor], fmt: QuantFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [n, k] weight that row-major `tensors` stand for, in `dtype`."""
    q, scales = tensors["qweight"], tensors["scales"]
    if fmt.name == "int8":
        return (q.float() * scales).to(dtype)
    n = q.shape[0]
    values = torch.stack((q & 0xF, q >> 4), dim=2).view(n, -1, fmt.group).float()
    return (values * scales.unsqueeze(2) + tensors["mins"].unsqueeze(2)).view(n, -1).to(dtype)


def packed_bytes(n: int, k: int, fmt: QuantFormat) -> int:
    """Bytes of `pack`'s tensors of an [n, k] weight (the 16-column panels, the last zero padded)."""
    cols = -(-n // PANEL_COLUMNS) * PANEL_COLUMNS
    if fmt.name == "int8":
        return cols * k + 4 * cols
    return cols * k // 2 + 8 * cols * (k // fmt.group)


def pack(tensors: dict[str, torch.Tensor], fmt: QuantFormat, n: int, k: int) -> dict[str, torch.Tensor]:
    """`quantize`'s row-major tensors of an [n, k] weight in the kernels' panel layout (module docstring),
    on pages of their own, so freeing them gives the memory straight back to the system."""
    why = fmt.check(n, k)
    if why is not None:
        raise ValueError(why)
    q = tensors["qweight"]
    if tuple(q.shape) != (n, k if fmt.name == "int8" else k // 2):
        raise ValueError(f"pack: qweight is {tuple(q.shape)}, but an [n, k] = [{n}, {k}] {fmt.name} weight stores "
                         f"[{n}, {k if fmt.name == 'int8' else k // 2}]; pass quantize()'s tensors of that weight")
    if not cpu_kernels_available():
        raise RuntimeError("quantized weights need the native CPU kernels, which are off (see the warning logged "
                           "above): unset RUNNER_CORE_NO_KERNELS or install gcc, or load without quantization")
    parts = kernels.pack_quantized(q, tensors["scales"], tensors.get("mins"), fmt.group)
    return dict(zip(("qpanels", "scales", "mins"), parts))


def quant_linear(x: torch.Tensor, packed: dict[str, torch.Tensor], fmt: QuantFormat, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] (float32 or bfloat16) @ W^T + bias -> [m, n] in x's dtype, W given as `pack`'s tensors
    (which loaded the kernels; no check here, so compiled graphs trace the op alone)."""
    return kernels.quant_linear(x, packed["qpanels"], packed["scales"], packed.get("mins"), n, fmt.group, bias)


def _columns(t: torch.Tensor, n: int) -> torch.Tensor:
    """[P, w, 16] panels -> the [n, w] row-major matrix they hold."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n]


def unpack(packed: dict[str, torch.Tensor], fmt: QuantFormat, n: int, k: int) -> dict[str, torch.Tensor]:
    """`pack`'s tensors of an [n, k] weight back as `quantize`'s row-major ones (the exact inverse)."""
    out = {name: _columns(t, n).contiguous() for name, t in packed.items()}
    out["qweight"] = out.pop("qpanels")
    return out


def dequantize_rows(packed: dict[str, torch.Tensor], fmt: QuantFormat, rows: torch.Tensor, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` (output channels, e.g. token ids of a tied LM head) of the weight `pack`'s tensors
    hold, dequantized to [len(rows), k] in `dtype`; only those rows are read."""
    panel, col = rows // PANEL_COLUMNS, rows % PANEL_COLUMNS
    q = packed["qpanels"][panel, :, col]  # [rows, k] int8 or [rows, k / 2] uint8
    if fmt.name == "int8":
        return (q.float() * packed["scales"][panel, 0, col].unsqueeze(1)).to(dtype)
    values = torch.stack((q & 0xF, q >> 4), dim=2).view(len(rows), -1, fmt.group).float()
    scales, mins = packed["scales"][panel, :, col], packed["mins"][panel, :, col]
    return (values * scales.unsqueeze(2) + mins.unsqueeze(2)).view(len(rows), k).to(dtype)
