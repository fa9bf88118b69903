"""Memory prediction before anything is loaded, and refusal of configurations that cannot fit.

`estimate_memory(model, ...)` reads config.json and the safetensors headers only (never the
tensors) and predicts, per device, the weights in the target dtype, the KV pool, the peak
transient memory of one forward pass and the rotary tables. `check_fits` turns a prediction
that exceeds the memory available into a `ConfigError` that says what would make it fit.

Per-device rules follow the runner's layers: with tensor parallelism each device holds
1/tp of every projection, of the (padded) vocabulary rows of the embedding and LM head,
and max(1, kv_heads/tp) KV heads (KV heads replicate when there are fewer than ranks);
norms and row-parallel biases replicate. With pipeline parallelism stage s holds its
contiguous share of the layers (earlier stages take the remainder), the embedding lives
on the first stage, the final norm and LM head on the last (tied embeddings count once
unless those are different stages). Figures are the maximum over devices.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from runner_core.errors import ConfigError, ModelLoadError
from runner_core.memory.sizing import kv_bytes_per_token

_MiB, _GiB = 2**20, 2**30
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MAX_HEADER = 256 * _MiB
# Token budget per step when max_num_batched_tokens is unset (RunnerConfig.effective_max_num_batched_tokens)
_DEFAULT_BATCHED_TOKENS = {"cuda": 2048, "cpu": 512}


# ---- what the formulas need from config.json ------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelShape":
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2",
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        )

    def kv_heads_per_device(self, tp: int) -> int:
        return max(1, self.num_kv_heads // tp)

    def checkpoint_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (name, shape) list of a Llama-family checkpoint with this shape (HF names)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        out = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                    (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i))]
            if self.qkv_bias:
                out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                        (p + "self_attn.v_proj.bias", (kv,))]
            if self.o_bias:
                out.append((p + "self_attn.o_proj.bias", (h,)))
            if self.mlp_bias:
                out += [(p + "mlp.gate_proj.bias", (i,)), (p + "mlp.up_proj.bias", (i,)),
                        (p + "mlp.down_proj.bias", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out


def read_safetensors_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]] | None:
    """(name, shape) of every tensor in the checkpoint at `path`, from the file headers only
    (8-byte little-endian length, then JSON); None when the directory has no safetensors."""
    from runner_core.model_loader import safetensors_files

    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        return None
    out = []
    for file in safetensors_files(path):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _MAX_HEADER:
                    raise ValueError(f"header length {size} is implausible")
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(
                f"safetensors file {file} has a corrupt header ({exc}); download or save it again") from exc
        out += [(name, tuple(meta["shape"])) for name, meta in header.items() if name != "__metadata__"]
    return out


# ---- per-device weights -----------------------------------------------------------------------
def _numel_per_device(name: str, shape: tuple[int, ...], tp: int, shape_info: ModelShape) -> int:
    numel = math.prod(shape)
    if tp == 1:
        return numel
    if "embed_tokens" in name or name.startswith("lm_head"):
        return -(-shape[0] // tp) * math.prod(shape[1:])  # vocabulary rows, padded to equal shards
    if len(shape) == 1 and "norm" in name:
        return numel
    if "k_proj" in name or "v_proj" in name:
        kv = shape_info.num_kv_heads
        return numel // tp if kv >= tp else numel // kv  # fewer KV heads than ranks: one head each
    if name.endswith("bias") and ("o_proj" in name or "down_proj" in name):
        return numel  # row-parallel bias, added once after the reduction
    return -(-numel // tp)


def _stage_layers(num_layers: int, pp: int) -> list[range]:
    base, extra = divmod(num_layers, pp)
    bounds, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        bounds.append(range(start, start + n))
        start += n
    return bounds


def _weights_per_stage(tensors, shape: ModelShape, tp: int, pp: int) -> list[int]:
    """Parameter elements held by one device of each pipeline stage."""
    stages = _stage_layers(shape.num_layers, pp)
    stage_of_layer = {layer: s for s, r in enumerate(stages) for layer in r}
    numel = [0] * pp
    for name, dims in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name.startswith("lm_head") and shape.tie_word_embeddings:
            continue  # tied: the embedding is the LM head
        n = _numel_per_device(name, dims, tp, shape)
        m = _LAYER.search(name)
        if m:
            numel[stage_of_layer.get(int(m.group(1)), pp - 1)] += n
        elif name.startswith("lm_head") or name.endswith("model.norm.weight") or name == "norm.weight":
            numel[pp - 1] += n
        else:
            numel[0] += n
            if "embed_tokens" in name and shape.tie_word_embeddings and pp > 1:
                numel[pp - 1] += n  # the last stage needs its own copy as the LM head
    return numel


# ---- activations --------------------------------------------------------------------------
def estimate_activation_peak(shape: ModelShape, *, num_tokens: int, num_seqs: int, dtype: str | torch.dtype,
                             tensor_parallel_size: int = 1, context_len: int | None = None,
                             decode_gather: bool = False) -> int:
    """Peak transient bytes of one forward over `num_tokens` tokens plus float32 logits for
    `min(num_seqs, num_tokens)` rows, on one device.

    The forward's peak is the largest of its phases, each counted with what is alive then:
    the hidden state and residual of the layer's caller and of the layer itself (4 x [T, H]),
    plus, in the MLP, gate_up [T, 2I], silu(gate) and the product ([T, I] each); in attention,
    qkv, the rotated q and k, the padded query grid, gathered keys and values, two outputs and
    the fused SDPA kernel's scratch;
    in RMSNorm, float32 temporaries. The logits phase holds the final hidden states and the
    [rows, vocab] logits (and their float32 copy below 32 bits; the gathered shards with tp).
    Index tensors (ids, positions, gather indices) add 32 bytes per token.

    `context_len` (when reading keys from the KV pool) is the longest context a step may
    attend to: a prefill chunk then gathers that many keys and values per layer (and a
    boolean mask of tokens x context). With `decode_gather` (no native paged kernel, e.g.
    CUDA here) every decode row gathers its whole context too, with a float32 bias and an
    int64 index of rows x context for the whole step.
    """
    b = _dtype_bytes(dtype)
    tp = tensor_parallel_size
    t = num_tokens
    rows = min(num_seqs, num_tokens)
    h, dh = shape.hidden_size, shape.head_dim
    q = shape.num_heads // tp * dh
    kv = shape.kv_heads_per_device(tp) * dh
    inter = -(-shape.intermediate_size // tp)
    vocab_shard = -(-shape.vocab_size // tp)

    base = 4 * t * h * b
    mlp = base + 4 * t * inter * b
    keys = t if context_len is None else max(t, context_len)
    # qkv, rotated q and k, output/grid/SDPA output (3q), SDPA's softmax scratch (~q/2, measured), keys and values
    attn = base + t * b * (q + 2 * kv) + t * b * (q + kv) + t * b * (3 * q + q // 2) + 2 * keys * kv * b
    if context_len is not None and context_len > t:
        attn += t * keys  # boolean mask of a chunk that continues a cached prefix
    norm = base + t * h * (8 + (4 if b != 4 else 0))
    logits = t * h * b + rows * vocab_shard * b
    if tp > 1:
        logits += 2 * rows * shape.vocab_size * b  # all-gathered shards and their concatenation
    if b != 4:
        logits += rows * shape.vocab_size * 4
    step = 32 * t
    if decode_gather and context_len is not None:
        ctx = max(1, context_len)
        step += rows * ctx * 12  # decode bias (float32) and gather index (int64)
        heads = shape.num_heads // tp
        attn = max(attn, base + rows * b * (3 * q + 2 * kv) + rows * ctx * b * (2 * kv + 2 * heads))
    return int(max(mlp, attn, norm, logits) + step)


# ---- the estimate -------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """Predicted memory per device (the maximum over devices), in bytes."""

    weights_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    kv_pool_tokens: int
    activation_peak_bytes: int
    total_per_device_bytes: int
    num_devices: int
    max_model_len: int
    dtype: str
    buffers_bytes: int = 0  # rotary cos/sin tables (float32)
    min_kv_pool_bytes: int = 0  # one max_model_len sequence, rounded up to whole blocks
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_memory: int | None = None
    device: str = "cpu"
    model: str = ""
    _inputs: Any = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV pool: weights, activation peak and buffers."""
        return self.weights_bytes + self.activation_peak_bytes + self.buffers_bytes

    def __str__(self) -> str:
        par = f"tp={self.tensor_parallel_size}, pp={self.pipeline_parallel_size}"
        rows = [
            ("weights", self.weights_bytes, f"{self.dtype}"),
            ("KV pool", self.kv_pool_bytes,
             f"{self.kv_pool_tokens} tokens x {self.kv_bytes_per_token / 1024:.1f} KiB/token"),
            ("activation peak", self.activation_peak_bytes,
             f"{self.max_num_batched_tokens} tokens, {min(self.max_num_seqs, self.max_num_batched_tokens)} "
             f"sampled rows"),
            ("rotary tables", self.buffers_bytes, ""),
            ("total", self.total_per_device_bytes, f"per device, {self.num_devices} device(s)"),
        ]
        lines = [f"Memory estimate for {self.model or 'model'} ({par}, max_model_len={self.max_model_len}, "
                 f"{self.device})", f"  {'':<16}{'MiB':>12}"]
        lines += [f"  {name:<16}{value / _MiB:>12.1f}  {note}".rstrip() for name, value, note in rows]
        return "\n".join(lines)


def _dtype_name(dtype: str | torch.dtype, device: str) -> str:
    from runner_core.config import _normalise_dtype

    name = _normalise_dtype(dtype)
    if name == "auto":
        return "float16" if device.startswith("cuda") else "float32"
    return name


def _dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return _DTYPE_BYTES[_dtype_name(dtype, "cpu")]


@dataclass(frozen=True)
class _Inputs:
    """What an estimate was computed from, so that check_fits can try other settings."""

    shape: ModelShape
    tensors: tuple
    args: dict


def estimate_memory(model: str | Path, *, dtype: str | torch.dtype = "auto", tensor_parallel_size: int = 1,
                    pipeline_parallel_size: int = 1, max_model_len: int | None = None, max_num_seqs: int = 256,
                    max_num_batched_tokens: int | None = None, block_size: int = 16,
                    kv_cache_memory: int | None = None, device: str | torch.device = "cpu",
                    trust_remote_code: bool = False) -> MemoryEstimate:
    """Predict the memory a configuration needs per device, before loading anything.

    `model` is resolved like the loader does (a directory, a preset built on first use, a hub id
    in the local cache). Weights come from the safetensors headers, cast to the target dtype,
    or from config.json alone (Llama-family layout) when there are no safetensors files.
    The KV pool is `kv_cache_memory` (bytes per device) if given, else room for `max_num_seqs`
    sequences of `max_model_len` tokens (default: max_position_embeddings).
    """
    from runner_core.model_loader import read_hf_config, resolve_model_path

    path = resolve_model_path(str(model))
    shape = ModelShape.from_hf_config(read_hf_config(path, trust_remote_code))
    tensors = read_safetensors_shapes(path)
    if tensors is None:
        tensors = shape.checkpoint_tensors()
    device = str(torch.device(device)) if isinstance(device, torch.device) else device
    args = dict(dtype=_dtype_name(dtype, device), tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size, kv_cache_memory=kv_cache_memory, device=device, model=str(model))
    return _estimate(_Inputs(shape, tuple(tensors), args))


def _estimate(inputs: _Inputs, **overrides) -> MemoryEstimate:
    shape, a = inputs.shape, {**inputs.args, **overrides}
    tp, pp, bs = a["tensor_parallel_size"], a["pipeline_parallel_size"], a["block_size"]
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size", "max_num_seqs"):
        if not isinstance(a[name], int) or a[name] < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {a[name]!r}")
    if pp > shape.num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the model's {shape.num_layers} layers")
    limit = shape.max_position_embeddings
    max_len = a["max_model_len"] or limit
    if max_len > limit:
        raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}; "
                          f"use max_model_len <= {limit}")
    device = a["device"]
    dev_type = "cuda" if device.startswith("cuda") else "cpu"
    dtype = a["dtype"]
    b = _DTYPE_BYTES[dtype]
    tokens = a["max_num_batched_tokens"] or max(a["max_num_seqs"], _DEFAULT_BATCHED_TOKENS[dev_type])

    weights = [n * b for n in _weights_per_stage(inputs.tensors, shape, tp, pp)]
    layers = [len(r) for r in _stage_layers(shape.num_layers, pp)]
    kv_heads = shape.kv_heads_per_device(tp)
    per_token = [kv_bytes_per_token(n, kv_heads, shape.head_dim, _torch_dtype(dtype)) for n in layers]
    bpt = max(per_token)
    if a["kv_cache_memory"] is not None:
        pool_tokens = a["kv_cache_memory"] // (bpt * bs) * bs
    else:
        pool_tokens = -(-a["max_num_seqs"] * max_len // bs) * bs
    buffers = [n * limit * shape.head_dim * 4 for n in layers]  # cos and sin, head_dim/2 each, float32
    act = estimate_activation_peak(shape, num_tokens=tokens, num_seqs=a["max_num_seqs"], dtype=dtype,
                                   tensor_parallel_size=tp, context_len=max_len, decode_gather=dev_type == "cuda")
    totals = [w + pool_tokens * k + act + buf for w, k, buf in zip(weights, per_token, buffers)]
    return MemoryEstimate(
        weights_bytes=max(weights), kv_bytes_per_token=bpt, kv_pool_bytes=pool_tokens * bpt,
        kv_pool_tokens=pool_tokens, activation_peak_bytes=act, total_per_device_bytes=max(totals),
        num_devices=tp * pp, max_model_len=max_len, dtype=dtype, buffers_bytes=max(buffers),
        min_kv_pool_bytes=-(-max_len // bs) * bs * bpt, block_size=bs, max_num_seqs=a["max_num_seqs"],
        max_num_batched_tokens=tokens, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        kv_cache_memory=a["kv_cache_memory"], device=device, model=a["model"],
        _inputs=_Inputs(shape, inputs.tensors, a))


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ---- refusal ------------------------------------------------------------------------------
def _fmt(n: int) -> str:
    return f"{n / _GiB:.2f} GiB" if abs(n) >= _GiB else f"{n / _MiB:.1f} MiB"


def required_bytes(estimate: MemoryEstimate) -> int:
    """Least memory per device the configuration can run in: weights, activation peak, rotary
    tables and the KV pool (`kv_cache_memory` when set, else one max_model_len sequence)."""
    pool = estimate.kv_pool_bytes if estimate.kv_cache_memory is not None else estimate.min_kv_pool_bytes
    return estimate.fixed_bytes + pool


def _valid_tp(shape: ModelShape, tp: int) -> bool:
    kv_ok = shape.num_kv_heads % tp == 0 if shape.num_kv_heads >= tp else tp % shape.num_kv_heads == 0
    return shape.num_heads % tp == 0 and shape.intermediate_size % tp == 0 and kv_ok


def fit_suggestions(estimate: MemoryEstimate, available_bytes: int) -> list[str]:
    """Single changes that would make `estimate` fit in `available_bytes` per device."""
    inputs = estimate._inputs
    if inputs is None:
        return []
    out = []
    if estimate.dtype == "float32":
        half = _estimate(inputs, dtype="bfloat16")
        verdict = "fits" if required_bytes(half) <= available_bytes else "not enough alone"
        out.append(f"dtype='bfloat16' or 'float16' (needs {_fmt(required_bytes(half))}: {verdict})")
    tp = estimate.tensor_parallel_size * 2
    while tp <= max(64, estimate.tensor_parallel_size * 2):
        if _valid_tp(inputs.shape, tp):
            more = _estimate(inputs, tensor_parallel_size=tp)
            if required_bytes(more) <= available_bytes:
                out.append(f"tensor_parallel_size={tp} (needs {_fmt(required_bytes(more))} per device)")
                break
        tp *= 2
    if estimate.kv_cache_memory is None and estimate.max_model_len > 1:
        lo, hi = 0, estimate.max_model_len - 1  # largest max_model_len that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if required_bytes(_estimate(inputs, max_model_len=mid)) <= available_bytes:
                lo = mid
            else:
                hi = mid - 1
        if lo >= 1:
            out.append(f"max_model_len={lo} (or shorter)")
    if estimate.kv_cache_memory is not None:
        room = available_bytes - estimate.fixed_bytes
        if room >= estimate.min_kv_pool_bytes:
            out.append(f"kv_cache_memory={room} ({_fmt(room)}) or less")
        elif room > 0:
            out.append(f"a smaller kv_cache_memory (at most {_fmt(room)} is left, but one "
                       f"{estimate.max_model_len}-token sequence needs {_fmt(estimate.min_kv_pool_bytes)})")
    return out


def check_fits(estimate: MemoryEstimate, available_bytes: int, *, gpu_memory_utilization: float = 0.9) -> None:
    """Raise ConfigError when weights + activation peak + rotary tables + the least KV pool
    (one max_model_len sequence, or kv_cache_memory when set) exceed `available_bytes`."""
    need = required_bytes(estimate)
    if need <= available_bytes:
        return
    if estimate.kv_cache_memory is not None:
        pool = f"KV cache {_fmt(estimate.kv_pool_bytes)} (kv_cache_memory)"
    else:
        pool = f"KV cache {_fmt(estimate.min_kv_pool_bytes)} for one {estimate.max_model_len}-token sequence"
    where = (f"available: {_fmt(available_bytes)} (gpu_memory_utilization={gpu_memory_utilization:g} of the device)"
             if estimate.device.startswith("cuda") else f"available: {_fmt(available_bytes)} of RAM")
    msg = (f"{estimate.model or 'the model'} does not fit: it needs {_fmt(need)} per device (weights "
           f"{_fmt(estimate.weights_bytes)} in {estimate.dtype}, "
           f"activation peak {_fmt(estimate.activation_peak_bytes)}, "
           f"rotary tables {_fmt(estimate.buffers_bytes)}, {pool}) but {where}.")
    tips = fit_suggestions(estimate, available_bytes)
    msg += (" Would fit with: " + "; ".join(tips) + "." if tips else
            " No single change of dtype, tensor_parallel_size, max_model_len or kv_cache_memory makes it fit; "
            "combine them or use a device with more memory.")
    raise ConfigError(msg)


def check_config_fits(config, available_bytes: int | None = None) -> MemoryEstimate:
    """Estimate `config` (a RunnerConfig) and refuse it with ConfigError if it cannot fit on its
    device (`available_bytes` defaults to `sizing.usable_memory_bytes`). Returns the estimate."""
    from runner_core.memory.sizing import usable_memory_bytes

    device = config.torch_device
    estimate = estimate_memory(
        config.model, dtype=config.torch_dtype, tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size, max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.effective_max_num_batched_tokens,
        block_size=config.block_size, kv_cache_memory=config.kv_cache_memory, device=str(device),
        trust_remote_code=config.trust_remote_code)
    if available_bytes is None:
        available_bytes = usable_memory_bytes(device, config.gpu_memory_utilization)
    check_fits(estimate, available_bytes, gpu_memory_utilization=config.gpu_memory_utilization)
    return estimate
