"""Refusal of configurations that cannot fit: the least memory a configuration needs, the
single changes that would make it fit (a lighter storage format of the weights first, with its
measured quality cost), and the `ConfigError` that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner_core.errors import ConfigError
from runner_core.memory.estimate import MemoryEstimate, estimate_from, estimate_memory
from runner_core.memory.shapes import MiB
from runner_core.memory.sizing import usable_memory_bytes

_GiB = 2**30

# The storage formats the advisor tries, the least compression first: bfloat16 is tried only where the compute
# dtype is float32 (it halves every weight and the KV cache), then int8, then int4 in groups of 32, 64 and 128
# (larger groups hold fewer scales: fewer bytes, a coarser fit to each weight's range).
STORAGE_LADDER = (
    ("bfloat16", {"dtype": "bfloat16"}),
    ("int8", {"quantization": "int8"}),
    ("int4 g32", {"quantization": "int4", "quantization_group_size": 32}),
    ("int4 g64", {"quantization": "int4", "quantization_group_size": 64}),
    ("int4 g128", {"quantization": "int4", "quantization_group_size": 128}),
)
# The one measurement the advisor quotes, and where it comes from: the trained tiny-speaker's (1M parameters)
# perplexity on held-out prose, each format's relative to float32's, from the run docs/benchmarks.md
# ("Weight formats") reports. It is what the format cost that small model, not a prediction for the model
# being fitted. Greedy agreement is not quoted: on the random-weight presets it measures rounding among
# near-tied logits, not language (docs/benchmarks.md). The run's int4 figures do not follow the group size.
QUALITY_RECORD = {
    "model": "tiny-speaker", "paragraphs": 400, "tokens": 8832, "float32_perplexity": 64.439,
    "command": "python benchmarks/quant.py --model small-llama",  # int8/int4 compute in float32
    "machine": "AMD EPYC Zen 5, avx512-bf16", "date": "2026-12-02",
}
QUALITY_COST: dict[str, float] = {  # perplexity / float32's perplexity - 1, as the record rounds it
    "bfloat16": 0.0001,
    "int8": -0.0004,
    "int4 g32": 0.0058,
    "int4 g64": 0.0059,
    "int4 g128": 0.0044,
}


@dataclass(frozen=True)
class StorageOption:
    """One storage format tried for an estimate: its settings, the stored weights and the need it gives."""

    label: str  # "bfloat16", "int8", "int4 g64", ...
    settings: dict  # the RunnerConfig fields that select it
    weights_bytes: int  # the weights stored in this format (per device)
    need_bytes: int  # required_bytes with it
    fits: bool

    @property
    def quality(self) -> str:
        """What the format cost in the one run measured (QUALITY_COST), naming the model and the run."""
        r = QUALITY_RECORD
        return (f"quality measured on {r['model']}, not on this model: perplexity {QUALITY_COST[self.label]:+.2%} "
                f"over {r['paragraphs']} held-out paragraphs, benchmarks/quant.py, {r['date']}")

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return (f"{settings} (weights {_fmt(self.weights_bytes)} stored, needs {_fmt(self.need_bytes)}: "
                f"{'fits' if self.fits else 'not enough alone'}, {self.quality})")


def _fmt(n: int) -> str:
    return f"{n / _GiB:.2f} GiB" if abs(n) >= _GiB else f"{n / MiB:.1f} MiB"


def required_bytes(estimate: MemoryEstimate) -> int:
    """Least memory per device the configuration can run in: weights, activation peak, rotary
    tables and the KV pool (`kv_cache_memory` when set, else one max_model_len sequence)."""
    pool = estimate.kv_pool_bytes if estimate.kv_cache_memory is not None else estimate.min_kv_pool_bytes
    return estimate.fixed_bytes + pool


def storage_ladder(estimate: MemoryEstimate) -> list[tuple[str, dict]]:
    """The entries of STORAGE_LADDER lighter than `estimate`'s own storage, in order: bfloat16 where
    it computes in float32, int8 unless it is quantized already, int4 in groups larger than its own;
    no format for a model the runner's own linear layers do not run (the transformers fallback)."""
    inputs = estimate.inputs
    if inputs is None:
        return []
    out = []
    for label, settings in STORAGE_LADDER:
        if label == "bfloat16":
            keep = estimate.dtype == "float32"
        elif not inputs.args["native_linears"]:
            keep = False
        elif estimate.quantization is None:
            keep = True
        else:  # any int4 after int8; after int4, the larger groups (fewer scales)
            keep = settings["quantization"] == "int4" and (
                estimate.quantization == "int8"
                or settings["quantization_group_size"] > estimate.quantization_group_size)
        if keep:
            out.append((label, settings))
    return out


def storage_options(estimate: MemoryEstimate, available_bytes: int) -> list[StorageOption]:
    """Each lighter storage format (`storage_ladder`) with its stored weights, need and verdict."""
    out = []
    for label, settings in storage_ladder(estimate):
        other = estimate_from(estimate.inputs, **settings)
        need = required_bytes(other)
        out.append(StorageOption(label, settings, other.weights_bytes, need, need <= available_bytes))
    return out


def fit_suggestions(estimate: MemoryEstimate, available_bytes: int) -> list[str]:
    """Single changes that would make `estimate` fit in `available_bytes` per device: the storage
    format with the smallest loss of quality that fits (else the one that needs least: "not enough alone"),
    more tensor-parallel devices, a shorter max_model_len, a smaller kv_cache_memory."""
    inputs = estimate.inputs
    if inputs is None or required_bytes(estimate) <= available_bytes:
        return []
    out = []
    options = storage_options(estimate, available_bytes)
    if options:
        out.append(next((o for o in options if o.fits), min(options, key=lambda o: o.need_bytes)).describe())
    tp = estimate.tensor_parallel_size * 2
    while tp <= max(64, estimate.tensor_parallel_size * 2):
        if inputs.shape.tp_problem(tp) is None:
            more = estimate_from(inputs, tensor_parallel_size=tp)
            if required_bytes(more) <= available_bytes:
                out.append(f"tensor_parallel_size={tp} (needs {_fmt(required_bytes(more))} per device)")
                break
        tp *= 2
    if estimate.kv_cache_memory is None and estimate.max_model_len > 1:
        lo, hi = 0, estimate.max_model_len - 1  # largest max_model_len that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if required_bytes(estimate_from(inputs, max_model_len=mid)) <= available_bytes:
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
           f"{_fmt(estimate.weights_bytes)} in {estimate.storage}, "
           f"activation peak {_fmt(estimate.activation_peak_bytes)}, "
           f"rotary tables {_fmt(estimate.buffers_bytes)}, {pool}) but {where}.")
    tips = fit_suggestions(estimate, available_bytes)
    msg += (" Would fit with: " + "; ".join(tips) + "." if tips else
            " No single change of storage format, tensor_parallel_size, max_model_len or kv_cache_memory makes it "
            "fit; combine them or use a device with more memory.")
    raise ConfigError(msg)


def check_config_fits(config, available_bytes: int | None = None, *,
                      packed_decode_weights: bool = False) -> MemoryEstimate:
    """Estimate `config` (a RunnerConfig) and refuse it with ConfigError if it cannot fit on its
    device (`available_bytes` defaults to `sizing.usable_memory_bytes`). With `packed_decode_weights`
    (the configuration builds CPU decode programs) their prepacked weights are counted, unless they
    would take over half the memory (the runner does not build them then). Returns the estimate."""
    device = config.torch_device
    estimate = estimate_memory(
        config.model, dtype=config.torch_dtype, tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size, pipeline_stage_layers=config.pipeline_stage_layers,
        max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.effective_max_num_batched_tokens, block_size=config.block_size,
        kv_cache_memory=config.kv_cache_memory, device=str(device), trust_remote_code=config.trust_remote_code,
        packed_decode_weights=packed_decode_weights, encoder_cache_tokens=config.effective_encoder_cache_tokens,
        model_impl=config.model_impl, quantization=config.quantization,
        quantization_group_size=config.quantization_group_size, quantize_lm_head=config.quantize_lm_head,
        draft_model=(config.speculative_config or {}).get("model"))
    if available_bytes is None:
        available_bytes = usable_memory_bytes(device, config.gpu_memory_utilization)
    if estimate.decode_programs_bytes > available_bytes // 2:  # the runner will not pack them (plan_sizes)
        estimate = estimate_from(estimate.inputs, packed_decode_weights=False)
    check_fits(estimate, available_bytes, gpu_memory_utilization=config.gpu_memory_utilization)
    return estimate
