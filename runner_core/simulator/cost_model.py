"""One engine step's predicted time from its shape, as a cost model you can read.

A step is what the scheduler hands the model: for each scheduled sequence the tokens already in its KV cache
(`starts`) and the tokens it runs now (`num_new_tokens`), and the rows that sample (`num_sampled`: those go
through the LM head). Per pipeline stage, on one device of the tensor-parallel group:

* linear layers, as a roofline: max(FLOPs / (peak x compute_efficiency), bytes / (bandwidth x memory_efficiency)),
  the bytes being the weights (in their stored format) plus the layers' inputs and outputs; the LM head only for
  the sampled rows; an MoE layer reads the experts its tokens hit (expected distinct experts of T tokens with
  top_k each, routing assumed uniform) and computes top_k experts per token;
* attention, per sequence, two kernels: a decode row (one new token) reads its KV cache ((s + 1) tokens at the
  KV cache's element size: the compute dtype's, or one byte with kv_cache_dtype="fp8"), memory-bound, at
  decode_attention_efficiency of the bandwidth; a prefill chunk (n > 1 new tokens) costs the larger of its
  FLOPs = 4 x query-key pairs x heads x head_dim per layer (pairs = n*s + n(n+1)/2 for s cached tokens) and
  its (s + n) tokens' KV read, at attention_efficiency;
* communication (docs/parallel.md's byte counts): with TP, two all-reduces per layer (and the embedding's) of
  T x hidden x dtype bytes, each latency + 2(tp-1)/tp x bytes / link bandwidth, and the sampled rows' logits
  all-gathered; with PP, a send of T x hidden x dtype bytes per stage boundary and the float32 logits of the
  sampled rows to rank 0.

The step is the sum of its stages (this engine keeps one batch in flight: a stage idles while the others run,
the share reported as `bubble_s`, already inside the total) plus the fixed costs: step_s + layers x layer_s +
sequences x seq_s + tokens x token_s. Of these, step_s + sequences x seq_s is the host's (scheduling, input
preparation, sampling and output bookkeeping) and the rest the device's (launch gaps, small kernels). This
engine runs the host's work between device steps, so the two add up; with `host_overlap` (an engine with an
overlap or asynchronous scheduler: TensorRT-LLM's PyTorch backend by default, vLLM's --async-scheduling, SGLang's
overlap scheduler) the host prepares the next step while the device runs this one, and a step takes the larger of
the two. TP beyond a node is priced at the same link (not modelled as a network).

Weights are stored as the runner stores them (layers/weight_storage.py): int8 and int4 are weight-only (1 byte +
a float32 scale per channel; half a byte + a float32 scale and minimum per group of 64), multiplied at the
compute dtype's peak; "fp8" is W8A8 (1 byte + a scale per channel) at the hardware's "fp8" peak, or weight-only
where it has none (as vLLM runs FP8 on Ampere). MoE routers, experts and the LM head keep the compute dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from runner_core.config import TORCH_DTYPES, dtype_bytes
from runner_core.errors import ConfigError
from runner_core.layers.quantization import QuantFormat
from runner_core.layers.weight_storage import layer_format
from runner_core.memory.estimate import linear_shapes, router_shapes
from runner_core.memory.shapes import ModelShape, kv_bytes_per_token, stage_layer_ranges
from runner_core.simulator.fit import fit_coefficients
from runner_core.simulator.hardware import Coefficients, HardwareSpec

__all__ = ["KV_CACHE_DTYPES", "WEIGHT_FORMATS", "CostModel", "fit_coefficients", "kv_element_bytes"]

WEIGHT_FORMATS = (None, "int8", "int4", "fp8")
KV_CACHE_DTYPES = (None, "fp8")  # None: the compute dtype


def kv_element_bytes(kv_cache_dtype: str | None, dtype: str) -> int:
    """Bytes of one K or V element: one for an FP8 KV cache, else the compute dtype's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not a KV cache format; use None (the compute "
                         f"dtype) or {', '.join(map(repr, KV_CACHE_DTYPES[1:]))}")
    return 1 if kv_cache_dtype == "fp8" else dtype_bytes(dtype)


@dataclass(frozen=True)
class _Stage:
    """One pipeline stage's per-device constants: seconds at 100% of the peaks per token / row, bytes per step."""

    layers: int
    compute_per_token: float  # linear layers and experts (seconds at peak)
    weight_bytes: int  # dense linear weights read every step
    act_bytes_per_token: int  # the linear layers' inputs and outputs
    expert_bytes: int  # one expert's weights in every sparse layer of the stage
    head_compute_per_row: float  # LM head (last stage)
    head_bytes: int
    head_act_bytes_per_row: int
    all_reduces: int  # per step: two per layer, plus the embedding's on the first stage
    last: bool


class CostModel:
    """Predicted step times of `shape` on `hardware` with `coefficients` (see the module docstring)."""

    def __init__(self, shape: ModelShape, hardware: HardwareSpec, coefficients: Coefficients, *, dtype: str,
                 weight_format: str | None = None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 pipeline_stage_layers: list[int] | None = None, kv_cache_dtype: str | None = None,
                 host_overlap: bool = False):
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not a compute dtype; use one of {', '.join(TORCH_DTYPES)}")
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format={weight_format!r} is not a storage format; use one of "
                             f"{', '.join(map(repr, WEIGHT_FORMATS))}")
        if dtype not in hardware.peak_flops:
            raise ValueError(f"{hardware.name} has no {dtype} peak (it has {', '.join(hardware.peak_flops)}); "
                             "choose one of those dtypes, or calibrate it")
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        problem = shape.tp_problem(tp)
        if problem:
            raise ConfigError(problem)
        kv_bytes = kv_element_bytes(kv_cache_dtype, dtype)
        self.shape, self.hardware, self.dtype, self.weight_format = shape, hardware, dtype, weight_format
        self.kv_cache_dtype = kv_cache_dtype
        if not isinstance(host_overlap, bool):
            raise ValueError(f"host_overlap must be True or False, got {host_overlap!r}")
        self.host_overlap = host_overlap
        self.tensor_parallel_size, self.pipeline_parallel_size = tp, pp
        # W8A8 fp8 where the hardware multiplies fp8; anything else multiplies at the compute dtype's peak
        self.compute_format = "fp8" if weight_format == "fp8" and "fp8" in hardware.peak_flops else dtype
        self._stages = [self._stage(r, s == 0, s == pp - 1)
                        for s, r in enumerate(stage_layer_ranges(shape.num_layers, pp, pipeline_stage_layers))]
        peak, bw, d = hardware.peak_flops[dtype], hardware.mem_bandwidth, shape.head_dim
        self._attn_per_pair = 4 * (shape.num_heads // tp) * d * shape.num_layers / peak
        self._attn_per_kv = (kv_bytes_per_token(shape.num_layers, shape.kv_heads_per_device(tp), d, dtype)
                             // dtype_bytes(dtype) * kv_bytes / bw)
        moe = shape.moe
        self._experts = (moe.num_experts, moe.top_k) if moe is not None and moe.sparse_layers else None
        b, link = dtype_bytes(dtype), hardware.link_bandwidth
        self._ring_per_token = 2 * (tp - 1) / tp * shape.hidden_size * b / link if tp > 1 else 0.0
        self._gather_per_row = (tp - 1) / tp * shape.vocab_size * b / link if tp > 1 else 0.0
        self._send_per_token = shape.hidden_size * b / link if pp > 1 else 0.0
        self._logits_per_row = shape.vocab_size * 4 / link if pp > 1 else 0.0
        self._set_coefficients(coefficients)

    # ---- construction ----------------------------------------------------------------------
    def _weight_bytes(self, n: int, k: int, quantized: bool) -> int:
        fmt, b = self.weight_format if quantized else None, dtype_bytes(self.dtype)
        if fmt == "fp8":
            return n * k + 4 * n
        if fmt is not None:
            stored = layer_format(QuantFormat.of(fmt), k)
            return stored.stored_bytes(n, k) if stored is not None else n * k * b
        return n * k * b

    def _stage(self, layers: range, first: bool, last: bool) -> _Stage:
        shape, tp, b = self.shape, self.tensor_parallel_size, dtype_bytes(self.dtype)
        peak_q, peak = self.hardware.peak_flops[self.compute_format], self.hardware.peak_flops[self.dtype]
        routers = router_shapes(shape, layers)
        quantized = linear_shapes(shape, tp, layers) - routers
        compute = sum(c * 2 * n * k for (n, k), c in quantized.items()) / peak_q
        compute += sum(c * 2 * n * k for (n, k), c in routers.items()) / peak
        weights = sum(c * self._weight_bytes(n, k, True) for (n, k), c in quantized.items())
        weights += sum(c * self._weight_bytes(n, k, False) for (n, k), c in routers.items())
        act = sum(c * (n + k) * b for (n, k), c in (quantized + routers).items())
        h, moe, expert_bytes = shape.hidden_size, shape.moe, 0
        if moe is not None and moe.sparse_layers:
            sparse, inter = len(set(moe.sparse_layers) & set(layers)), -(-moe.intermediate_size // tp)
            expert_bytes = sparse * 3 * h * inter * b
            compute += sparse * moe.top_k * 6 * h * inter / peak
            act += sparse * moe.top_k * (2 * h + 3 * inter) * b
        vocab = -(-shape.vocab_size // tp)
        return _Stage(
            layers=len(layers), compute_per_token=compute, weight_bytes=weights, act_bytes_per_token=act,
            expert_bytes=expert_bytes, head_compute_per_row=2 * vocab * h / peak if last else 0.0,
            head_bytes=vocab * h * b if last else 0, head_act_bytes_per_row=(h + vocab) * b if last else 0,
            all_reduces=2 * len(layers) + (1 if first else 0), last=last)

    def _set_coefficients(self, c: Coefficients) -> None:
        for name in ("compute_efficiency", "memory_efficiency", "attention_efficiency", "decode_attention_efficiency"):
            if not getattr(c, name) > 0:
                raise ValueError(f"{name}={getattr(c, name)!r} must be > 0 (a fraction of the peak)")
        self.coefficients = c

    def with_coefficients(self, coefficients: Coefficients) -> CostModel:
        """The same model and layout with other coefficients (no recomputation of the per-stage constants)."""
        other = copy.copy(self)
        other._set_coefficients(coefficients)
        return other

    # ---- one step ----------------------------------------------------------------------------
    def _terms(self, starts, num_new_tokens, num_sampled: int):
        """(tokens, seqs, (prefill, decode) attention seconds at 100%, [(stage compute s, memory s, weight bytes
        read, comm s)])."""
        if len(starts) != len(num_new_tokens):
            raise ValueError(f"starts has {len(starts)} entries but num_new_tokens {len(num_new_tokens)}: "
                             "give one of each per scheduled sequence")
        tokens, seqs, pair, kv = sum(num_new_tokens), len(num_new_tokens), self._attn_per_pair, self._attn_per_kv
        # a decode row (one new token) reads s + 1 KV tokens; only the prefill chunks need a look each
        others = [(s, n) for s, n in zip(starts, num_new_tokens) if n != 1]
        decode_kv = sum(starts) - sum(s for s, _ in others) + seqs - len(others)
        attention = (sum(max((n * s + n * (n + 1) / 2) * pair, (s + n) * kv) for s, n in others), decode_kv * kv)
        bw, rows = self.hardware.mem_bandwidth, num_sampled
        hit = 0.0
        if self._experts is not None:
            e, k = self._experts
            hit = e * (1.0 - (1.0 - k / e) ** tokens)
        lat = self.hardware.link_latency_s
        stages = []
        for st in self._stages:
            weights = st.weight_bytes + hit * st.expert_bytes
            act = tokens * st.act_bytes_per_token
            compute = tokens * st.compute_per_token
            comm = st.all_reduces * (lat + tokens * self._ring_per_token) if self._ring_per_token else 0.0
            if st.last and rows:
                weights += st.head_bytes
                act += rows * st.head_act_bytes_per_row
                compute += rows * st.head_compute_per_row
                comm += (lat + rows * self._gather_per_row if self._gather_per_row else 0.0) + (
                    lat + rows * self._logits_per_row if self._logits_per_row else 0.0)
            if not st.last and self._send_per_token:
                comm += lat + tokens * self._send_per_token
            stages.append((compute, (weights + act) / bw, weights, comm))
        return tokens, seqs, attention, stages

    def _fixed(self, tokens: int, seqs: int) -> tuple[float, float]:
        """(host seconds: step_s + seqs x seq_s, device seconds: layers x layer_s + tokens x token_s)."""
        c = self.coefficients
        return c.step_s + seqs * c.seq_s, self.shape.num_layers * c.layer_s + tokens * c.token_s

    def _total(self, device: float, host: float) -> float:
        return max(device, host) if self.host_overlap else device + host

    def _attention_s(self, attention: tuple[float, float]) -> float:
        c = self.coefficients
        return attention[0] / c.attention_efficiency + attention[1] / c.decode_attention_efficiency

    def step_time(self, starts: list[int], num_new_tokens: list[int], num_sampled: int) -> float:
        """Predicted seconds of one step (see the module docstring)."""
        tokens, seqs, attention, stages = self._terms(starts, num_new_tokens, num_sampled)
        c = self.coefficients
        ce, me = c.compute_efficiency, c.memory_efficiency
        host, device = self._fixed(tokens, seqs)
        device += self._attention_s(attention)
        for compute, memory, _, comm in stages:
            device += max(compute / ce, memory / me) + comm
        return self._total(device, host)

    def breakdown(self, starts: list[int], num_new_tokens: list[int], num_sampled: int) -> dict:
        """The step's time by part: {"linear_s", "attention_s", "comm_s", "bubble_s" (idle share of the stages'
        time, inside total_s), "fixed_s" (host and device), "host_s" (its host part), "hidden_s" (host time run
        under the device's, with host_overlap), "total_s" (the parts less hidden_s), "bound": "compute" | "memory"
        (the linear layers'), "weight_bytes" (read per device, all stages)}."""
        tokens, seqs, attention, stages = self._terms(starts, num_new_tokens, num_sampled)
        c = self.coefficients
        ce, me = c.compute_efficiency, c.memory_efficiency
        linear = {"compute": 0.0, "memory": 0.0}
        for compute, memory, _, _ in stages:
            bound = "compute" if compute / ce >= memory / me else "memory"
            linear[bound] += max(compute / ce, memory / me)
        attention_s, comm = self._attention_s(attention), sum(s[3] for s in stages)
        busy = sum(linear.values()) + attention_s + comm
        host, device = self._fixed(tokens, seqs)
        total = self._total(busy + device, host)
        return {"linear_s": sum(linear.values()), "attention_s": attention_s, "comm_s": comm,
                "bubble_s": busy * (1 - 1 / self.pipeline_parallel_size), "fixed_s": host + device, "host_s": host,
                "hidden_s": busy + device + host - total, "total_s": total,
                "bound": "compute" if linear["compute"] >= linear["memory"] else "memory",
                "weight_bytes": sum(s[2] for s in stages)}

    def features(self, starts: list[int], num_new_tokens: list[int], num_sampled: int) -> dict[str, float]:
        """The fit's regressors: the step time is linear_compute_s / compute_efficiency + linear_memory_s /
        memory_efficiency + attention_s / attention_efficiency + decode_attention_s / decode_attention_efficiency +
        one x step_s + layers x layer_s + seqs x seq_s + tokens x token_s + comm_s. The linear terms are seconds at
        100% of the peaks, each stage's counted under the bound this model's coefficients give it: refit with
        `with_coefficients(fitted)` until it settles. Only a model whose host and device work add up
        (host_overlap False, as this engine runs) is linear in its coefficients."""
        if self.host_overlap:
            raise ValueError("features() describe a step whose host and device work add up; with host_overlap the "
                             "step is the larger of the two, not linear in the coefficients: fit a CostModel built "
                             "with host_overlap=False")
        tokens, seqs, attention, stages = self._terms(starts, num_new_tokens, num_sampled)
        ce, me = self.coefficients.compute_efficiency, self.coefficients.memory_efficiency
        compute_s = sum(s[0] for s in stages if s[0] / ce >= s[1] / me)
        memory_s = sum(s[1] for s in stages if s[0] / ce < s[1] / me)
        return {"linear_compute_s": compute_s, "linear_memory_s": memory_s, "attention_s": attention[0],
                "decode_attention_s": attention[1], "one": 1.0,
                "layers": float(self.shape.num_layers), "seqs": float(seqs), "tokens": float(tokens),
                "comm_s": sum(s[3] for s in stages)}

    def total_weight_bytes(self) -> int:
        """Every weight byte of one device per stage, summed (the LM head and every expert included): what a step
        would read if it touched all of them."""
        return sum(st.weight_bytes + (self._experts[0] * st.expert_bytes if self._experts else 0) + st.head_bytes
                   for st in self._stages)
