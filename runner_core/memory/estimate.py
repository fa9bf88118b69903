"""Memory prediction before anything is loaded.

`estimate_memory(model, ...)` reads config.json and the safetensors headers only (never the
tensors) and predicts, per device, the weights at their stored size (the compute dtype, or the
int8/int4 storage format of the linear layers), the KV pool, the peak transient memory of one
forward pass and the rotary tables. Figures are the maximum over devices; the per-device weight
rules live in `shapes`, the bytes of one stored linear weight in `layers.weight_storage`, the
fit checks in `fit`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from runner_core.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    QUANT_GROUP_SIZES,
    QUANTIZATIONS,
    TORCH_DTYPES,
    auto_dtype,
    checkpoint_dtype,
    dtype_bytes,
    normalise_dtype,
    resolve_max_model_len,
)
from runner_core.errors import ConfigError
from runner_core.layers.attention import default_backend
from runner_core.layers.flex_attention import Q_BLOCK
from runner_core.layers.linear import packed_bytes
from runner_core.layers.quantization import QuantFormat
from runner_core.layers.weight_storage import layer_format, panels_apply, weight_bytes
from runner_core.memory.shapes import (
    MiB,
    ModelShape,
    kv_bytes_per_token,
    read_safetensors_shapes,
    stage_layer_ranges,
    weights_per_stage,
)


# ---- activations --------------------------------------------------------------------------
def estimate_activation_peak(shape: ModelShape, *, num_tokens: int, num_seqs: int, dtype: str | torch.dtype,
                             tensor_parallel_size: int = 1, context_len: int | None = None,
                             attention_backend: str | None = None) -> int:
    """Peak transient bytes of one forward over `num_tokens` tokens plus float32 logits for
    `min(num_seqs, num_tokens)` rows, on one device.

    The forward's peak is the largest of its phases, each counted with what is alive then:
    the hidden state and residual of the layer's caller and of the layer itself (4 x [T, H]),
    plus, in the MLP, gate_up [T, 2I], silu(gate) and the product ([T, I] each); in attention,
    qkv, the rotated q and k, the padded query grid, gathered keys and values, two outputs and
    the fused SDPA kernel's scratch;
    in RMSNorm, float32 temporaries; in an MoE layer (`_moe_peak`), the routing and the tokens
    gathered per expert. The logits phase holds the final hidden states and the
    [rows, vocab] logits (and their float32 copy below 32 bits; the gathered shards with tp).
    Index tensors (ids, positions, gather indices) add 32 bytes per token.

    `context_len` (when reading keys from the KV pool) is the longest context a step may attend to, and
    `attention_backend` (resolved: "gather", "native", "flex") how they are read. "gather" (and None)
    copies that many keys and values per layer for a prefill chunk (and a boolean mask of tokens x
    context); "gather" also for every decode row, with a float32 bias and an int64 index of rows x
    context for the whole step. "native" and "flex" read the pool in place: no keys are copied; flex
    pads each decode row to a Q_BLOCK-row query tile (its grid, output and row metadata).
    """
    b = dtype_bytes(dtype)
    tp = tensor_parallel_size
    t = num_tokens
    rows = min(num_seqs, num_tokens)
    h, dh = shape.hidden_size, shape.head_dim
    q = shape.num_heads // tp * dh
    kv = shape.kv_heads_per_device(tp) * dh
    inter = -(-shape.intermediate_size // tp)
    vocab_shard = -(-shape.vocab_size // tp)

    base = 4 * t * h * b
    mlp = base + 4 * t * inter * b if shape.dense_layers else 0
    moe = _moe_peak(shape.moe, t, h, b, tp, base) if shape.moe is not None and shape.moe.sparse_layers else 0
    in_place = context_len is not None and attention_backend in ("native", "flex")
    keys = t if context_len is None else max(t, context_len)
    # qkv, rotated q and k, output/grid/SDPA output (3q), SDPA's softmax scratch (~q/2, measured), keys and values
    attn = base + t * b * (q + 2 * kv) + t * b * (q + kv) + t * b * (3 * q + q // 2) + 2 * keys * kv * b
    if in_place:  # no gathered keys nor mask; flex: a padded query grid, its output, each row's sequence and position
        padded = t + rows * (Q_BLOCK - 1) if attention_backend == "flex" else t
        attn = base + t * b * (q + 2 * kv) + t * b * (q + kv) + padded * (3 * q * b + 16)
    elif context_len is not None and context_len > t:
        attn += t * keys  # boolean mask of a chunk that continues a cached prefix
    norm = base + t * h * (8 + (4 if b != 4 else 0))
    logits = t * h * b + rows * vocab_shard * b
    if tp > 1:
        logits += 2 * rows * shape.vocab_size * b  # all-gathered shards and their concatenation
    if b != 4:
        logits += rows * shape.vocab_size * 4
    step = 32 * t
    if attention_backend == "gather" and context_len is not None:
        ctx = max(1, context_len)
        step += rows * ctx * 12  # decode bias (float32) and gather index (int64)
        heads = shape.num_heads // tp
        attn = max(attn, base + rows * b * (3 * q + 2 * kv) + rows * ctx * b * (2 * kv + 2 * heads))
    return int(max(mlp, moe, attn, norm, logits) + step)


def _moe_peak(moe, t: int, h: int, b: int, tp: int, base: int) -> int:
    """An MoE layer (layers/fused_moe.py) over t tokens: router logits [t, E] and their float32
    softmax, the top-k weights and ids and the sort's index tensors (t*k each), the tokens gathered
    per expert and the experts' outputs ([t*k, H] each), then either one expert's gated activation
    over at most t tokens (gate_up [t, 2I], silu and product [t, I]) or the weighted outputs
    (float32 [t*k, H], a cast copy below 32 bits) and the summed result [t, H]. A shared expert runs
    after the experts, alongside their result."""
    k, inter = moe.top_k, -(-moe.intermediate_size // tp)
    routed = base + t * moe.num_experts * (b + 4) + t * k * 48 + 2 * t * k * h * b
    experts = max(4 * t * inter * b, t * k * h * (4 + (b if b != 4 else 0)) + t * h * b)
    shared = -(-moe.shared_expert_intermediate_size // tp)
    return max(routed + experts, base + 2 * t * h * b + 4 * t * shared * b if shared else 0)


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
    decode_programs_bytes: int = 0  # CPU decode programs' MKL-prepacked weights (compiled, one device)
    dense_weights_bytes: int = 0  # the same weights, every one in the compute dtype (unpadded)
    quantization: str | None = None  # the linear weights' storage format: None (the compute dtype), int8, int4
    quantization_group_size: int = 64  # int4: weights per scale along k
    quantize_lm_head: bool = False
    encoder_cache_bytes: int = 0  # a multimodal model's cached image features (encoder_cache_tokens rows)
    draft_weights_bytes: int = 0  # a speculative draft model's weights and buffers (in weights_bytes too)
    draft_kv_bytes_per_token: int = 0  # its pool's per token (in kv_bytes_per_token too: both pools hold a token)
    min_kv_pool_bytes: int = 0  # one max_model_len sequence, rounded up to whole blocks
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_memory: int | None = None
    device: str = "cpu"
    model: str = ""
    inputs: Any = field(default=None, repr=False, compare=False)  # an EstimateInputs: estimate_from() again

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "inputs"}

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV pool: weights, activation peak, buffers, prepacked weights, image features."""
        return (self.weights_bytes + self.activation_peak_bytes + self.buffers_bytes + self.decode_programs_bytes
                + self.encoder_cache_bytes)

    @property
    def storage(self) -> str:
        """The weights' storage in words: "float32", "int8 (bfloat16 compute)", "int4 g64 + LM head (...)"."""
        if self.quantization is None:
            return self.dtype
        fmt = self.quantization + (f" g{self.quantization_group_size}" if self.quantization == "int4" else "")
        return f"{fmt}{' + LM head' if self.quantize_lm_head else ''} ({self.dtype} compute)"

    def __str__(self) -> str:
        par = f"tp={self.tensor_parallel_size}, pp={self.pipeline_parallel_size}"
        rows = [
            ("weights", self.weights_bytes, self.storage + (
                f", {self.dense_weights_bytes / MiB:.1f} MiB in {self.dtype}" if self.quantization else "") + (
                f", draft model {self.draft_weights_bytes / MiB:.1f} MiB" if self.draft_weights_bytes else "")),
            ("KV pool", self.kv_pool_bytes,
             f"{self.kv_pool_tokens} tokens x {self.kv_bytes_per_token / 1024:.1f} KiB/token"),
            ("activation peak", self.activation_peak_bytes,
             f"{self.max_num_batched_tokens} tokens, {min(self.max_num_seqs, self.max_num_batched_tokens)} "
             f"sampled rows"),
            ("rotary tables", self.buffers_bytes, ""),
            *([("decode programs", self.decode_programs_bytes, "MKL-prepacked linear weights (compiled, CPU)")]
              if self.decode_programs_bytes else []),
            *([("encoder cache", self.encoder_cache_bytes, "image features kept for reuse")]
              if self.encoder_cache_bytes else []),
            ("total", self.total_per_device_bytes, f"per device, {self.num_devices} device(s)"),
        ]
        lines = [f"Memory estimate for {self.model or 'model'} ({par}, max_model_len={self.max_model_len}, "
                 f"{self.device})", f"  {'':<16}{'MiB':>12}"]
        lines += [f"  {name:<16}{value / MiB:>12.1f}  {note}".rstrip() for name, value, note in rows]
        return "\n".join(lines)


def _dtype_name(dtype: str | torch.dtype, device: str, model: str | Path) -> str:
    name = normalise_dtype(dtype)
    kind = device.split(":")[0]
    return auto_dtype(kind, checkpoint_dtype(model) if kind == "cpu" else None)[0] if name == "auto" else name


@dataclass(frozen=True)
class EstimateInputs:
    """What an estimate was computed from, so that check_fits can try other settings."""

    shape: ModelShape
    tensors: tuple
    args: dict


def estimate_memory(model: str | Path, *, dtype: str | torch.dtype = "auto", tensor_parallel_size: int = 1,
                    pipeline_parallel_size: int = 1, pipeline_stage_layers: list[int] | None = None,
                    max_model_len: int | None = None, max_num_seqs: int = 256,
                    max_num_batched_tokens: int | None = None, block_size: int = 16,
                    kv_cache_memory: int | None = None, device: str | torch.device = "cpu",
                    trust_remote_code: bool = False, packed_decode_weights: bool = False,
                    encoder_cache_tokens: int | None = None, model_impl: str = "auto",
                    quantization: str | None = None, quantization_group_size: int = 64,
                    quantize_lm_head: bool = False, attention_backend: str = "auto",
                    draft_model: str | None = None) -> MemoryEstimate:
    """Predict the memory a configuration needs per device, before loading anything.

    `model` is resolved like the loader does (a directory, a preset built on first use, a hub id
    in the local cache), config-only models included: a config suffices (runner_core.models.catalogue).
    Weights come from the safetensors headers, cast to the target dtype, or from config.json alone
    (Llama-family layout) when there are no safetensors files.
    The KV pool is `kv_cache_memory` (bytes per device) if given, else room for `max_num_seqs`
    sequences of `max_model_len` tokens (default: max_position_embeddings). Pipeline stages hold
    `pipeline_stage_layers` decoder layers each (default: an even split). With
    `packed_decode_weights` (a compiled single-device float32 CPU runner), the CPU decode programs'
    MKL-prepacked copies of the linear weights are counted too. A multimodal model also holds its
    vision tower and projector and `encoder_cache_tokens` rows of image features (default:
    max_num_batched_tokens). An architecture the runner cannot build under `model_impl` is refused
    first (ModelLoadError naming it and what would work).

    `quantization` ("int8" | "int4", with `quantization_group_size`) stores the runner's linear
    layers in that format; the embedding, norms and biases stay in the compute dtype, and so does
    the LM head unless `quantize_lm_head` (a tied embedding then reads its rows from it). Where the
    CPU kernels multiply panels (one process, the native linear layers) a linear weight is held in
    that layout only, padded to whole panels: `weights_bytes` is then what memory_stats() reports
    after load, and `dense_weights_bytes` what the same weights take in the compute dtype.
    `attention_backend` (RunnerConfig's choices) says how attention reads the pool: gathering
    copies of the keys, or in place ("auto" on CUDA: flex). `draft_model` (speculative decoding) adds its
    weights and a KV pool holding as many tokens as the target's (memory/draft.py: the budget is split).
    """
    from runner_core.loader.model_loader import read_hf_config, resolve_model_path
    from runner_core.models import MODEL_REGISTRY

    for name, value, allowed in (("quantization", quantization, QUANTIZATIONS),
                                 ("quantization_group_size", quantization_group_size, QUANT_GROUP_SIZES)):
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not a storage format setting; use one of "
                              f"{', '.join(map(repr, allowed))}")
    path = resolve_model_path(str(model), weights=False)
    hf_config = read_hf_config(path, trust_remote_code)
    adapter = MODEL_REGISTRY.get_adapter(hf_config, model_impl, trust_remote_code=trust_remote_code)
    shape = ModelShape.from_hf_config(hf_config)
    multimodal = getattr(hf_config, "vision_config", None) is not None
    tensors = read_safetensors_shapes(path)
    if tensors is None:
        tensors = shape.checkpoint_tensors() + (vision_tensors(hf_config) if multimodal else [])
    device = str(torch.device(device)) if isinstance(device, torch.device) else device
    args = dict(dtype=_dtype_name(dtype, device, model), tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size, pipeline_stage_layers=pipeline_stage_layers,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size, kv_cache_memory=kv_cache_memory, device=device, model=str(model),
                packed_decode_weights=packed_decode_weights, native_linears=adapter.impl == "native",
                quantization=quantization, quantization_group_size=quantization_group_size,
                quantize_lm_head=bool(quantize_lm_head), attention_backend=attention_backend,
                encoder_cache_tokens=(encoder_cache_tokens if encoder_cache_tokens is not None else
                                      max_num_batched_tokens) if multimodal else 0)
    args["draft"] = (0, 0)
    if draft_model is not None:
        d = estimate_memory(draft_model, dtype=args["dtype"], max_model_len=resolve_max_model_len(
            max_model_len, shape.max_position_embeddings), kv_cache_memory=0, device=device, max_num_seqs=1)
        args["draft"] = (d.weights_bytes + d.buffers_bytes, d.kv_bytes_per_token)
    return estimate_from(EstimateInputs(shape, tuple(tensors), args))


def estimate_from(inputs: EstimateInputs, **overrides) -> MemoryEstimate:
    """The estimate of `inputs` with some of its settings changed (`overrides`: estimate_memory's keywords)."""
    shape, a = inputs.shape, {**inputs.args, **overrides}
    tp, pp, bs = a["tensor_parallel_size"], a["pipeline_parallel_size"], a["block_size"]
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size", "max_num_seqs"):
        if not isinstance(a[name], int) or a[name] < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {a[name]!r}")
    stages = stage_layer_ranges(shape.num_layers, pp, a["pipeline_stage_layers"])
    limit = shape.max_position_embeddings
    max_len = resolve_max_model_len(a["max_model_len"], limit)
    device = a["device"]
    dev_type = "cuda" if device.startswith("cuda") else "cpu"
    dtype = a["dtype"]
    b = dtype_bytes(dtype)
    tokens = a["max_num_batched_tokens"] or max(a["max_num_seqs"], DEFAULT_MAX_NUM_BATCHED_TOKENS[dev_type])

    dense = [n * b for n in weights_per_stage(inputs.tensors, shape, tp, stages)]
    panels = a["native_linears"] and panels_apply(dev_type, TORCH_DTYPES[dtype], tp * pp)
    weights = ([d + _linear_bytes_over_dense(shape, tp, r, r is stages[-1], a, panels)
                for d, r in zip(dense, stages)] if a["native_linears"] else dense)
    layers = [len(r) for r in stages]
    kv_heads = shape.kv_heads_per_device(tp)
    draft_weights, draft_bpt = a.get("draft", (0, 0))
    per_token = [kv_bytes_per_token(n, kv_heads, shape.head_dim, dtype) + draft_bpt for n in layers]
    weights = [w + draft_weights for w in weights]
    bpt = max(per_token)
    if a["kv_cache_memory"] is not None:
        pool_tokens = a["kv_cache_memory"] // (bpt * bs) * bs
    else:
        pool_tokens = -(-a["max_num_seqs"] * max_len // bs) * bs
    # one cos and sin table per model, float32, over the positions a step reaches (model_loader.py)
    buffers = [min(limit, max(max_len, tokens)) * shape.head_dim * 4 if n else 0 for n in layers]
    backend = default_backend(dev_type) if a["attention_backend"] == "auto" else a["attention_backend"]
    act = estimate_activation_peak(shape, num_tokens=tokens, num_seqs=a["max_num_seqs"], dtype=dtype,
                                   tensor_parallel_size=tp, context_len=max_len, attention_backend=backend)
    # MKL's copies for the CPU decode programs, only where the linear weights stay row-major (no panels)
    packed = (packed_bytes(linear_shapes(shape)) if a["packed_decode_weights"] and tp * pp == 1
              and dtype == "float32" and a["quantization"] is None and not panels else 0)
    encoder = (a["encoder_cache_tokens"] if a["encoder_cache_tokens"] is not None else tokens) * shape.hidden_size * b
    totals = [w + pool_tokens * k + act + buf + packed + encoder
              for w, k, buf in zip(weights, per_token, buffers)]
    return MemoryEstimate(
        weights_bytes=max(weights), kv_bytes_per_token=bpt, kv_pool_bytes=pool_tokens * bpt,
        kv_pool_tokens=pool_tokens, activation_peak_bytes=act, total_per_device_bytes=max(totals),
        num_devices=tp * pp, max_model_len=max_len, dtype=dtype, buffers_bytes=max(buffers),
        decode_programs_bytes=packed, dense_weights_bytes=max(dense), quantization=a["quantization"],
        quantization_group_size=a["quantization_group_size"], quantize_lm_head=a["quantize_lm_head"],
        encoder_cache_bytes=encoder, draft_weights_bytes=draft_weights, draft_kv_bytes_per_token=draft_bpt,
        min_kv_pool_bytes=-(-max_len // bs) * bs * bpt, block_size=bs, max_num_seqs=a["max_num_seqs"],
        max_num_batched_tokens=tokens, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        kv_cache_memory=a["kv_cache_memory"], device=device, model=a["model"],
        inputs=EstimateInputs(shape, inputs.tensors, a))


def vision_tensors(hf_config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a multimodal model's vision tower and projector, from its config alone (the
    modules built on the meta device: no memory, no weights)."""
    from transformers import AutoModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    with torch.device("meta"):
        tower, projector = AutoModel.from_config(hf_config.vision_config), LlavaMultiModalProjector(hf_config)
    return ([(f"vision_tower.{n}", tuple(p.shape)) for n, p in tower.named_parameters()]
            + [(f"multi_modal_projector.{n}", tuple(p.shape)) for n, p in projector.named_parameters()])


def _linear_bytes_over_dense(shape: ModelShape, tp: int, layers: range, last: bool, a: dict, panels: bool) -> int:
    """What one device of a stage holding `layers` (and the LM head when `last`) stores for its linear
    weights beyond their elements in the compute dtype: `weight_bytes` of each per-device [n, k] weight
    (quantized, panel-padded) minus n x k x dtype bytes."""
    dtype = TORCH_DTYPES[a["dtype"]]
    fmt = QuantFormat.of(a["quantization"], a["quantization_group_size"]) if a["quantization"] else None

    def extra(n: int, k: int, fmt: QuantFormat | None) -> int:
        return weight_bytes(n, k, dtype, fmt and layer_format(fmt, k), panels) - n * k * dtype.itemsize

    total = sum(count * extra(n, k, fmt) for (n, k), count in linear_shapes(shape, tp, layers).items())
    # the MoE routers keep the compute dtype (models/moe.py)
    routers = router_shapes(shape, layers)
    total -= sum(count * (extra(n, k, fmt) - extra(n, k, None)) for (n, k), count in routers.items())
    if last:
        total += extra(-(-shape.vocab_size // tp), shape.hidden_size, fmt if a["quantize_lm_head"] else None)
    return total


def router_shapes(shape: ModelShape, layers: range) -> Counter:
    """[out, in] shapes (with counts) of the MoE routers in `layers`: each sparse layer's router and the
    shared expert's gate (replicated on every device)."""
    moe = shape.moe
    if moe is None or not moe.sparse_layers:
        return Counter()
    sparse = len(set(moe.sparse_layers) & set(layers))
    return Counter({(moe.num_experts, shape.hidden_size): sparse,
                    **({(1, shape.hidden_size): sparse} if moe.shared_expert_intermediate_size else {})})


def linear_shapes(shape: ModelShape, tp: int = 1, layers: range | None = None) -> Counter:
    """[out, in] shapes (with counts) of the runner's fused linear weights on one of `tp` devices, in
    `layers` (default: all): qkv, o per layer; gate_up, down per dense layer; an MoE layer's router,
    shared expert and its gate (replicated: router and gate; experts are no linear layers)."""
    layers = range(shape.num_layers) if layers is None else layers
    h, d = shape.hidden_size, shape.head_dim
    i = -(-shape.intermediate_size // tp)
    q, kv = shape.num_heads // tp * d, shape.kv_heads_per_device(tp) * d
    dense, moe = len(set(shape.dense_layers) & set(layers)), shape.moe
    shapes = Counter({(q + 2 * kv, h): len(layers), (h, q): len(layers)})
    shapes.update({(2 * i, h): dense, (h, i): dense})
    if moe is not None and moe.sparse_layers:
        sparse = len(set(moe.sparse_layers) & set(layers))
        s = -(-moe.shared_expert_intermediate_size // tp)
        shapes.update({(moe.num_experts, h): sparse})
        if s:
            shapes.update({(2 * s, h): sparse, (h, s): sparse, (1, h): sparse})
    return Counter({k: v for k, v in shapes.items() if v})
