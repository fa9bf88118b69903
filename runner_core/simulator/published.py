"""Published serving figures of real GPUs with their exact settings (`PUBLISHED`), and `compare_published`,
which simulates each figure's workload at the low, typical and high ends of the hardware's efficiency band
and says whether the published value falls inside.

Only figures whose settings are stated in full are here: engine and version, model, weight format, GPUs and
tensor parallelism, fixed input/output lengths, the request count and arrivals, the metric. What the
published engine does that this one does not (FP8 kernels and FP8 KV cache, CUDA graphs, its own batch
heuristics) is in each figure's notes; the band is datasheet x efficiency and is not tuned to fit them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner_core.simulator.backend import SimulatorBackend
from runner_core.simulator.simulation import Simulation
from runner_core.tuning.request_metrics import Target
from runner_core.tuning.workload import Arrivals, Lengths, Workload

BANDS = ("low", "typical", "high")
METRICS = ("output_throughput", "total_token_throughput")  # keys of a run's summary
_TRTLLM_V1 = ("https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6/"
              "docs/source/performance/perf-overview.md")
_TRTLLM_V05 = "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/performance.md"
_TRTLLM_V05_H200 = "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/blogs/H200launch.md"
_V1_HOW = ("trtllm-bench throughput, PyTorch backend, CUDA graphs with padding, every request queued at once; "
           "max batch size and token budget not stated (we use the engine's defaults); our KV cache is bfloat16 (the "
           "engine has no FP8 KV), so the pool holds half the sequences an FP8 KV cache would and decode reads twice "
           "the KV bytes")
_V05_HOW = ("gptSessionBenchmark, static batching: one batch of `batch` requests run to the end (we run them as "
            "one burst with max_num_seqs = batch)")


def _fixed(num_requests: int, prompt: int, output: int) -> Workload:
    return Workload(num_requests=num_requests, arrivals=Arrivals.burst(), prompt_len=Lengths.fixed(prompt),
                    output_len=Lengths.fixed(output))


@dataclass(frozen=True)
class PublishedFigure:
    """One published measurement and the settings it was taken with. `model` is a name of model_configs,
    `hardware` a HARDWARE name, `weight_format` the simulation's (None: the config's dtype), `kv_dtype` the
    published KV cache format ("not stated" when the source does not say), `workload` the requests as
    published (fixed lengths, all due at once for an offline run), `max_num_seqs` the stated batch limit
    (None: not stated), `metric` a run summary key and `value` the published figure in its unit."""

    name: str
    source: str
    engine: str
    published_model: str
    model: str
    hardware: str
    tensor_parallel_size: int
    weight_format: str | None
    kv_dtype: str
    workload: Workload
    metric: str
    value: float
    max_num_seqs: int | None = None
    notes: str = ""
    dtype: str = "bfloat16"

    def config(self) -> dict:
        """The RunnerConfig fields of the simulated run (max_model_len = the longest request)."""
        longest = self.workload.prompt_len.high + self.workload.output_len.high
        out = {"model": self.model, "dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size,
               "max_model_len": longest}
        return out if self.max_num_seqs is None else {**out, "max_num_seqs": self.max_num_seqs}

    @property
    def settings(self) -> str:
        w = self.workload
        return (f"{self.engine}; {self.published_model} ({self.weight_format or self.dtype} weights, KV "
                f"{self.kv_dtype}); {self.tensor_parallel_size}x {self.hardware}; ISL/OSL "
                f"{w.prompt_len.label}/{w.output_len.label}; {w.num_requests} requests, {w.arrivals.label}"
                + ("" if self.max_num_seqs is None else f", batch {self.max_num_seqs}"))


PUBLISHED: list[PublishedFigure] = [
    PublishedFigure(
        name="trtllm1.0-llama3.3-70b-fp8-h100-tp2-1000-1000", source=_TRTLLM_V1, engine="TensorRT-LLM 1.0",
        published_model="nvidia/Llama-3.3-70B-Instruct-FP8", model="llama-3-70b", hardware="h100-sxm",
        tensor_parallel_size=2, weight_format="fp8", kv_dtype="not stated", workload=_fixed(3000, 1000, 1000),
        metric="output_throughput", value=4205.0,
        notes=f"{_V1_HOW}. Llama 3.3 70B has Llama-3-70B's layers (131072 positions). FP8 GEMMs and attention "
              "kernels of TensorRT-LLM; a larger batch than our 256 if its heuristic picks one."),
    PublishedFigure(
        name="trtllm1.0-llama3.3-70b-fp8-h200-tp1-1000-1000", source=_TRTLLM_V1, engine="TensorRT-LLM 1.0",
        published_model="nvidia/Llama-3.3-70B-Instruct-FP8", model="llama-3-70b", hardware="h200",
        tensor_parallel_size=1, weight_format="fp8", kv_dtype="not stated", workload=_fixed(3000, 1000, 1000),
        metric="output_throughput", value=2909.0,
        notes=f"{_V1_HOW}. One GPU: 70 GB of FP8 weights leave ~55 GB for KV, so the batch is KV-bound."),
    PublishedFigure(
        name="trtllm1.0-llama3.1-8b-fp8-h100-tp1-1000-1000", source=_TRTLLM_V1, engine="TensorRT-LLM 1.0",
        published_model="nvidia/Llama-3.1-8B-Instruct-FP8", model="llama-3.1-8b", hardware="h100-sxm",
        tensor_parallel_size=1, weight_format="fp8", kv_dtype="not stated", workload=_fixed(3000, 1000, 1000),
        metric="output_throughput", value=15220.0,
        notes=f"{_V1_HOW}. A small model at large batch: per-step CPU overhead and attention dominate; "
              "TensorRT-LLM's batch can exceed our default 256."),
    PublishedFigure(
        name="trtllm1.0-llama3.1-8b-fp8-h100-tp1-2048-128", source=_TRTLLM_V1, engine="TensorRT-LLM 1.0",
        published_model="nvidia/Llama-3.1-8B-Instruct-FP8", model="llama-3.1-8b", hardware="h100-sxm",
        tensor_parallel_size=1, weight_format="fp8", kv_dtype="not stated", workload=_fixed(3000, 2048, 128),
        metric="output_throughput", value=3450.0,
        notes=f"{_V1_HOW}. Prefill-heavy: the figure tests the compute (FP8 tensor core) efficiency."),
    PublishedFigure(
        name="trtllm0.5-llama2-70b-fp8-h100-tp4-128-128", source=_TRTLLM_V05, engine="TensorRT-LLM 0.5.0",
        published_model="LLaMA 70B (Llama 2 70B)", model="llama-2-70b", hardware="h100-sxm",
        tensor_parallel_size=4, weight_format="fp8", kv_dtype="not stated", workload=_fixed(64, 128, 128),
        metric="output_throughput", value=3317.0, max_num_seqs=64,
        notes=f"{_V05_HOW}. 'Throughput (out tok/s)' of the H100 FP8 high-throughput table."),
    PublishedFigure(
        name="trtllm0.5-llama2-70b-fp8-h200-tp1-128-128", source=_TRTLLM_V05_H200, engine="TensorRT-LLM 0.5.0",
        published_model="llama_70b (Llama 2 70B)", model="llama-2-70b", hardware="h200",
        tensor_parallel_size=1, weight_format="fp8", kv_dtype="not stated", workload=_fixed(512, 128, 128),
        metric="output_throughput", value=3014.0, max_num_seqs=512,
        notes=f"{_V05_HOW}. 'Preliminary measured performance' of the H200 launch post (TensorRT 9.1.0.4)."),
]


@dataclass
class Comparison:
    """A figure against its simulation: the predicted metric at each band end, whether the published
    value lies in [low, high], and typical / published."""

    figure: PublishedFigure
    predicted: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def row(self) -> dict:
        p, value = self.predicted, self.figure.value
        inside = None if self.error else p["low"] <= value <= p["high"]
        return {"figure": self.figure.name, "settings": self.figure.settings, "metric": self.figure.metric,
                "published": value, **{f"predicted_{b}": p.get(b) for b in BANDS}, "inside": inside,
                "ratio": None if self.error else p["typical"] / value, "source": self.figure.source,
                "notes": self.figure.notes, "error": self.error}


def compare_published(num_requests: int | None = 512, figures: list[PublishedFigure] | None = None) -> list[dict]:
    """For each figure (default: PUBLISHED), its workload (at most `num_requests` requests; None: as
    published) simulated on its hardware and layout at the band's low, typical and high ends. One row per
    figure: figure, settings, metric, published, predicted_low / _typical / _high, inside (published within
    [low, high]), ratio (typical / published), source, notes, and error (why it could not be simulated, a
    layout that does not fit, else None)."""
    if num_requests is not None and (not isinstance(num_requests, int) or num_requests < 1):
        raise ValueError(f"num_requests must be an int >= 1 or None (as published), got {num_requests!r}")
    rows = []
    for figure in PUBLISHED if figures is None else figures:
        if figure.metric not in METRICS:
            raise ValueError(f"figure {figure.name}: metric {figure.metric!r} is not one of {METRICS}")
        n = figure.workload.num_requests if num_requests is None else min(num_requests, figure.workload.num_requests)
        workload = figure.workload.replace(num_requests=n)
        comparison = Comparison(figure)
        try:
            simulate = Simulation(hardware=figure.hardware, band=BANDS[0], weight_format=figure.weight_format)
            with SimulatorBackend(figure.config(), simulate) as backend:
                for band in BANDS:
                    backend.apply({"band": band})
                    comparison.predicted[band] = backend.run(workload, Target()).summary[figure.metric]
        except ValueError as e:  # the layout does not fit the hardware (ConfigError)
            comparison.error = str(e)
        rows.append(comparison.row())
    return rows
