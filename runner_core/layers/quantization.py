"""Weight storage formats apart from the compute dtype: what int8 and int4 hold and how a float weight
becomes one (and back, for the reference path and for saving).

- int8: symmetric, one float32 scale per output channel: w[n, k] ~ scale[n] * q[n, k], q in [-127, 127].
- int4: asymmetric, groups of `group` weights along k, each with a float32 scale and minimum:
  w ~ scale[n, g] * q + min[n, g], q in [0, 15]. Asymmetric because a group of real (or random) weights
  is rarely centred on zero: a minimum lets all 16 levels span the group's own range, where a symmetric
  format would leave levels unused on the side the group does not reach (llama.cpp's Q4_1 against Q4_0).
  Row-major storage packs two k values per byte: the low nibble holds the even k, the high the odd one.

Row-major tensors (`quantize`) are what a checkpoint saved by this project holds; the kernels multiply
their own panel layout of them (runner_core/kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """Row-major quantized tensors of an [n, k] float weight: {"qweight", "scales"} for int8 (int8 [n, k],
    float32 [n, 1]); {"qweight", "scales", "mins"} for int4 (uint8 [n, k / 2], float32 [n, k / group] twice)."""
    why = fmt.check(*weight.shape)
    if why is not None:
        raise ValueError(why)
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
