"""Rotary position embedding (neox layout, as in Hugging Face Llama) with linear and Llama-3 scaling.

The cos/sin tables are the same for every layer of a model: `RotaryEmbedding.shared` hands all
layers built from one config the one module (and so one pair of tables), and `rotary_positions`
caps their length while a model is built (the positions a runner can reach, not the model's
max_position_embeddings).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths scaled by `factor`, short kept, smooth between."""
    factor = params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, smoothed, out)


_POSITIONS_CAP: ContextVar[int | None] = ContextVar("rotary_positions", default=None)
# (id of the model's config, table settings, device) -> the first layer's module, whose tables the others share
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@contextmanager
def rotary_positions(limit: int | None) -> Iterator[None]:
    """Rotary tables built inside hold at most `limit` positions (None: the model's own limit)."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"rotary_positions takes an int >= 1 or None, got {limit!r}")
    token = _POSITIONS_CAP.set(limit)
    try:
        yield
    finally:
        _POSITIONS_CAP.reset(token)


class RotaryEmbedding(nn.Module):
    @classmethod
    def shared(cls, scope: object, head_dim: int, max_position: int, base: float,
               scaling: dict | None = None) -> RotaryEmbedding:
        """A layer's module over the one pair of tables that every layer built from `scope` (the model's
        config) with these settings shares, capped by `rotary_positions`. Each layer gets its own module
        (a module reached by several paths confuses torch.func.functional_call, which exported programs
        run through: it restores a shared module's tensors wrongly); the tables are the first one's,
        held weakly here: dropping the model frees them."""
        cap = _POSITIONS_CAP.get()
        positions = max_position if cap is None else min(cap, max_position)
        key = (id(scope), head_dim, positions, base, repr(sorted((scaling or {}).items())),
               str(torch.get_default_device()))
        first = _SHARED.get(key)
        if first is None:
            first = _SHARED[key] = cls(head_dim, positions, base, scaling)
            return first
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.register_buffer("cos", first.cos, persistent=False)
        module.register_buffer("sin", first.sin, persistent=False)
        return module

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type '{rope_type}' is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [N, heads, head_dim], k: [N, kv_heads, head_dim], positions: [N]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
