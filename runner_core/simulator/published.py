"""Published serving figures of real GPUs with their exact settings (`PUBLISHED`), and `compare_published`,
which simulates each figure's workload at the low, typical and high ends of the hardware's efficiency band
and says whether the published value falls inside.

Only figures whose settings are stated in full are here: engine and version, model, weight format, GPUs and
tensor parallelism, fixed input/output lengths, the request count and arrivals, the metric. The KV cache
format and the batch limits are the source's where it gives them, else derived by the rule the source's tool
documents (trtllm-bench's, `trtllm_limits`), else ours, each with its source in `setting_sources`; what the
published engine's scheduler does that this engine's does not by default (an overlap scheduler, admission only
of requests whose whole KV fits) is simulated as that engine runs, with its source in `engine_sources`. FP8
attention kernels and CUDA graphs are in the notes; the band is datasheet x efficiency and is not tuned to fit.

These TensorRT-LLM figures are the ones the simulator was developed against (docs/whatif.md has the history);
`held_out.HELD_OUT` holds figures from other sources that nothing was developed against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner_core.simulator.backend import SimulatorBackend
from runner_core.simulator.hardware import BANDS
from runner_core.simulator.simulation import Simulation
from runner_core.simulator.trtllm_limits import SOURCE as TRTLLM_BENCH_RULE
from runner_core.simulator.trtllm_limits import trtllm_bench_limits
from runner_core.tuning.request_metrics import Target
from runner_core.tuning.workload import Arrivals, Lengths, Workload

METRICS = ("output_throughput", "total_token_throughput")  # keys of a run's summary
_TRTLLM_V1 = ("https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6/"
              "docs/source/performance/perf-overview.md")
_TRTLLM_V05 = "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/performance.md"
_TRTLLM_V05_H200 = "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/blogs/H200launch.md"
_V1_HOW = ("trtllm-bench throughput, PyTorch backend, CUDA graphs with padding, every request queued at once, "
           "options 'at their default settings' (perf-overview)")
_V05_HOW = ("gptSessionBenchmark, static batching: one batch of `batch` requests run to the end (we run them as "
            "one burst with max_num_seqs = batch)")
UNSTATED = "unstated, our default"
# trtllm-bench (1.0, PyTorch backend) settings its sources give where perf-overview states none
_V1_KV = ("fp8: trtllm-bench's kv_cache_config dtype 'auto' takes the checkpoint's kv_cache_quant_algo "
          "(tensorrt_llm/bench/benchmark/utils/general.py get_settings -> validate_and_set_kv_cache_quant), and "
          "NVIDIA's ModelOpt FP8 checkpoints write kv_cache_quant_algo FP8 in hf_quant_config.json (the "
          "checkpoint's file itself not read here)")
_V1_BATCH = (f"derived by trtllm_limits.trtllm_bench_limits, the rule of {TRTLLM_BENCH_RULE} (max_batch_size and "
             "max_num_tokens not given): requests the KV memory holds at ISL+OSL with FP8 weights and KV and the "
             "default kv_cache_free_gpu_mem_fraction 0.90, rounded up")
_V1_TOKENS = _V1_BATCH + "; chunked prefill off: at least ISL + max_batch_size"
_V1_ENGINE = {
    "async_scheduling": "TensorRT-LLM 1.0 PyTorch backend: the overlap scheduler is on unless "
                        "disable_overlap_scheduler (tensorrt_llm/llmapi/llm_args.py, default False)",
    "no_evict": "TensorRT-LLM's capacity scheduler policy defaults to GUARANTEED_NO_EVICT (llm_args.py "
                "SchedulerConfig; docs 'Useful Runtime Options'): a request is admitted only when the KV of its whole "
                "ISL+OSL is free, so the batch is at most the pool's whole requests (this engine admits more and "
                "preempts)"}
# settled_requests of the 1.0 figures: 2 x trtllm-bench's max_batch_size requests (at least two of the no-evict
# batches the runs use). The predicted output tok/s (low / typical / high) against the published 3000 requests,
# measured with these settings: 8B H100 1000/1000 (1280 requests) 9061 / 12422 / 15857, (3000) 9071 / 12422 / 15840
# in 40 s against 70 s; 70B H200 TP1 1000/1000 (448) 2075 / 2789 / 3516, (3000) 2172 / 2946 / 3742 (5% higher) in
# 7 s against 44 s. compare_published(num_requests=3000) runs them as published.


def _fixed(num_requests: int, prompt: int, output: int) -> Workload:
    return Workload(num_requests=num_requests, arrivals=Arrivals.burst(), prompt_len=Lengths.fixed(prompt),
                    output_len=Lengths.fixed(output))


@dataclass(frozen=True)
class PublishedFigure:
    """One published measurement and the settings it was taken with. `model` is a config-only model's name,
    `hardware` a HARDWARE name, `weight_format` the simulation's (None: the config's dtype),
    `kv_cache_dtype` the simulation's KV cache format (None: the compute dtype), `workload` the requests
    as published (fixed lengths, all due at once for an offline run), `max_num_seqs` and
    `max_num_batched_tokens` the engine's batch limits (None: our default), `metric` a run summary key and
    `value` the published figure in its unit. `setting_sources` says where each of kv_cache_dtype,
    max_num_seqs and max_num_batched_tokens comes from ("unstated, our default" where no source gives it).
    `async_scheduling` (the host's work overlapped with the device's, Simulation.async_scheduling) and
    `no_evict` (admit a request only when the KV of its whole ISL+OSL is free: the run's max_num_seqs is capped
    at the pool's whole requests) are the published engine's scheduler, with their sources in `engine_sources`."""

    name: str
    source: str
    engine: str
    published_model: str
    model: str
    hardware: str
    tensor_parallel_size: int
    weight_format: str | None
    workload: Workload
    metric: str
    value: float
    kv_cache_dtype: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    setting_sources: dict[str, str] = field(default_factory=dict)
    settled_requests: int | None = None
    notes: str = ""
    dtype: str = "bfloat16"
    async_scheduling: bool = False
    no_evict: bool = False
    engine_sources: dict[str, str] = field(default_factory=dict)

    def config(self) -> dict:
        """The RunnerConfig fields of the simulated run (max_model_len = the longest request)."""
        longest = self.workload.prompt_len.high + self.workload.output_len.high
        out = {"model": self.model, "dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size,
               "max_model_len": longest, "max_num_seqs": self.max_num_seqs,
               "max_num_batched_tokens": self.max_num_batched_tokens}
        return {k: v for k, v in out.items() if v is not None}

    def simulation(self, band: str = "typical") -> Simulation:
        return Simulation(hardware=self.hardware, band=band, weight_format=self.weight_format,
                          kv_cache_dtype=self.kv_cache_dtype, async_scheduling=self.async_scheduling)

    @property
    def settings(self) -> str:
        w = self.workload
        limits = ", ".join(f"{k} {v}" for k, v in (("batch", self.max_num_seqs),
                                                    ("token budget", self.max_num_batched_tokens)) if v)
        return (f"{self.engine}; {self.published_model} ({self.weight_format or self.dtype} weights, KV "
                f"{self.kv_cache_dtype or self.dtype}); {self.tensor_parallel_size}x {self.hardware}; ISL/OSL "
                f"{w.prompt_len.label}/{w.output_len.label}; {w.num_requests} requests, {w.arrivals.label}"
                + (f", {limits}" if limits else ""))


def _v1(name: str, published_model: str, model: str, hardware: str, tp: int, prompt: int, output: int,
        value: float, notes: str) -> PublishedFigure:
    """A TensorRT-LLM 1.0 perf-overview figure: FP8 weights and KV, trtllm-bench's batch limits derived by its rule,
    its overlap scheduler and no-evict admission."""
    limits = trtllm_bench_limits(model, hardware, tensor_parallel_size=tp, input_len=prompt, output_len=output)
    batch = limits.max_batch_size
    return PublishedFigure(
        name=name, source=_TRTLLM_V1, engine="TensorRT-LLM 1.0", published_model=published_model, model=model,
        hardware=hardware, tensor_parallel_size=tp, weight_format="fp8", workload=_fixed(3000, prompt, output),
        metric="output_throughput", value=value, kv_cache_dtype="fp8", max_num_seqs=batch,
        max_num_batched_tokens=limits.max_num_tokens, settled_requests=2 * batch,
        setting_sources={"kv_cache_dtype": _V1_KV, "max_num_seqs": _V1_BATCH, "max_num_batched_tokens": _V1_TOKENS},
        async_scheduling=True, no_evict=True, engine_sources=dict(_V1_ENGINE), notes=f"{_V1_HOW}. {notes}")


_V05_SOURCES = {"kv_cache_dtype": UNSTATED, "max_num_seqs": "stated: the table's batch size",
                "max_num_batched_tokens": "static batching runs the whole batch's prompts in one step: "
                                          "batch x ISL"}
_V05_ENGINE = {"async_scheduling": "not overlapped (inferred: 0.5.0 predates the overlap scheduler; "
                                    "gptSessionBenchmark's C++ session runs its host work between steps)",
               "no_evict": "static batching: the whole batch is admitted at once and runs to the end"}

PUBLISHED: list[PublishedFigure] = [
    _v1("trtllm1.0-llama3.3-70b-fp8-h100-tp2-1000-1000", "nvidia/Llama-3.3-70B-Instruct-FP8", "llama-3-70b",
        "h100-sxm", 2, 1000, 1000, 4205.0,
        "Llama 3.3 70B has Llama-3-70B's layers (131072 positions). FP8 GEMMs and attention kernels of "
        "TensorRT-LLM."),
    _v1("trtllm1.0-llama3.3-70b-fp8-h200-tp1-1000-1000", "nvidia/Llama-3.3-70B-Instruct-FP8", "llama-3-70b",
        "h200", 1, 1000, 1000, 2909.0,
        "One GPU: 70 GB of FP8 weights leave ~55 GB for KV, so the batch is KV-bound."),
    _v1("trtllm1.0-llama3.1-8b-fp8-h100-tp1-1000-1000", "nvidia/Llama-3.1-8B-Instruct-FP8", "llama-3.1-8b",
        "h100-sxm", 1, 1000, 1000, 15220.0,
        "A small model at large batch: per-step CPU overhead and attention dominate."),
    _v1("trtllm1.0-llama3.1-8b-fp8-h100-tp1-2048-128", "nvidia/Llama-3.1-8B-Instruct-FP8", "llama-3.1-8b",
        "h100-sxm", 1, 2048, 128, 3450.0,
        "Prefill-heavy: the figure tests the compute (FP8 tensor core) efficiency."),
    _v1("trtllm1.0-llama3.1-8b-fp8-h200-tp1-1000-1000", "nvidia/Llama-3.1-8B-Instruct-FP8", "llama-3.1-8b",
        "h200", 1, 1000, 1000, 17744.0, "The H100 figure's run on the H200's larger, faster memory."),
    _v1("trtllm1.0-llama3.1-8b-fp8-h200-tp1-2048-128", "nvidia/Llama-3.1-8B-Instruct-FP8", "llama-3.1-8b",
        "h200", 1, 2048, 128, 3538.0, "Prefill-heavy, as the H100 figure."),
    PublishedFigure(
        name="trtllm0.5-llama2-70b-fp8-h100-tp4-128-128", source=_TRTLLM_V05, engine="TensorRT-LLM 0.5.0",
        published_model="LLaMA 70B (Llama 2 70B)", model="llama-2-70b", hardware="h100-sxm",
        tensor_parallel_size=4, weight_format="fp8", workload=_fixed(64, 128, 128),
        metric="output_throughput", value=3317.0, max_num_seqs=64, max_num_batched_tokens=64 * 128,
        setting_sources=_V05_SOURCES, engine_sources=dict(_V05_ENGINE),
        notes=f"{_V05_HOW}. 'Throughput (out tok/s)' of the H100 FP8 high-throughput table."),
    PublishedFigure(
        name="trtllm0.5-llama2-70b-fp8-h200-tp1-128-128", source=_TRTLLM_V05_H200, engine="TensorRT-LLM 0.5.0",
        published_model="llama_70b (Llama 2 70B)", model="llama-2-70b", hardware="h200",
        tensor_parallel_size=1, weight_format="fp8", workload=_fixed(512, 128, 128),
        metric="output_throughput", value=3014.0, max_num_seqs=512, max_num_batched_tokens=512 * 128,
        setting_sources=_V05_SOURCES, engine_sources=dict(_V05_ENGINE),
        notes=f"{_V05_HOW}. 'Preliminary measured performance' of the H200 launch post (TensorRT 9.1.0.4)."),
]


@dataclass
class Comparison:
    """A figure against its simulation: the predicted metric at each band end, whether the published
    value lies in [low, high], and typical / published."""

    figure: PublishedFigure
    predicted: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    max_num_seqs: int | None = None  # the batch limit the run used (a no-evict figure's: capped at whole requests)

    def row(self) -> dict:
        p, value = self.predicted, self.figure.value
        inside = None if self.error else p["low"] <= value <= p["high"]
        return {"figure": self.figure.name, "settings": self.figure.settings,
                "setting_sources": dict(self.figure.setting_sources), "metric": self.figure.metric,
                "published": value, **{f"predicted_{b}": p.get(b) for b in BANDS}, "inside": inside,
                "ratio": None if self.error else p["typical"] / value, "source": self.figure.source,
                "max_num_seqs_run": self.max_num_seqs, "async_scheduling": self.figure.async_scheduling,
                "engine_sources": dict(self.figure.engine_sources), "notes": self.figure.notes, "error": self.error}


class _StepShapes:
    """A simulated engine's cost model that also keeps every step's shape, so the run can be priced again at
    other coefficients (`duration`)."""

    def __init__(self, cost_model) -> None:
        self.cost_model, self.shapes = cost_model, []

    def step_time(self, starts, num_new_tokens, num_sampled: int) -> float:
        self.shapes.append((list(starts), list(num_new_tokens), num_sampled))
        return self.cost_model.step_time(starts, num_new_tokens, num_sampled)

    def __getattr__(self, name):
        return getattr(self.cost_model, name)

    def duration(self, coefficients) -> float:
        """The steps' total time at `coefficients`."""
        model = self.cost_model.with_coefficients(coefficients)
        return sum(model.step_time(*shape) for shape in self.shapes)


def _banded(backend: SimulatorBackend, workload: Workload, metric: str) -> dict[str, float]:
    """The metric at each band end. With every request due at once (no arrival times), the schedule does not
    depend on the step times, so one run at the typical end gives the steps, and the other ends' durations
    are those steps priced at their coefficients (the metric is tokens / duration); else one run per end."""
    if workload.arrivals.kind not in ("burst", "concurrency"):
        out = {}
        for band in BANDS:
            backend.apply({"band": band})
            out[band] = backend.run(workload, Target()).summary[metric]
        return out
    engine = backend.runner.engine
    shapes = engine.cost_model = _StepShapes(engine.cost_model)
    try:
        summary = backend.run(workload, Target()).summary
    finally:
        engine.cost_model = shapes.cost_model
    hardware = shapes.cost_model.hardware
    tokens = summary[metric] * summary["duration_s"]
    return {band: tokens / shapes.duration(hardware.coefficients(band)) for band in BANDS}


def no_evict_batch(backend: SimulatorBackend, figure: PublishedFigure) -> int:
    """The batch an engine that admits a request only when the KV of its whole ISL+OSL is free can run: the
    pool's blocks over one request's blocks, at most the figure's max_num_seqs (our default when unset)."""
    capacity = backend.capacity()
    block = capacity["block_size"]
    longest = figure.workload.prompt_len.high + figure.workload.output_len.high
    whole = capacity["kv_tokens"] // block // -(-longest // block)
    return max(1, min(capacity["max_num_seqs"], whole))


def compare_published(num_requests: int | None = None, figures: list[PublishedFigure] | None = None) -> list[dict]:
    """For each figure (default: PUBLISHED), its workload (at most `num_requests` requests; None: the
    figure's settled_requests, else as published) simulated on its hardware and layout at the band's low,
    typical and high ends (one run, its steps priced at each end's coefficients: the figures' requests are all
    due at once). One row per figure: figure, settings, setting_sources, metric, published, predicted_low /
    _typical / _high, inside (published within [low, high]), ratio (typical / published), source,
    max_num_seqs_run (the batch limit the run used: a no_evict figure's capped by `no_evict_batch`),
    async_scheduling, engine_sources, notes, and error (why it could not be simulated, a layout that does not
    fit, else None)."""
    if num_requests is not None and (not isinstance(num_requests, int) or num_requests < 1):
        raise ValueError(f"num_requests must be an int >= 1 or None (each figure's settled_requests), got "
                         f"{num_requests!r}")
    rows = []
    for figure in PUBLISHED if figures is None else figures:
        if figure.metric not in METRICS:
            raise ValueError(f"figure {figure.name}: metric {figure.metric!r} is not one of {METRICS}")
        n = min(num_requests or figure.settled_requests or figure.workload.num_requests, figure.workload.num_requests)
        comparison = Comparison(figure)
        try:
            with SimulatorBackend(figure.config(), figure.simulation()) as backend:
                if figure.no_evict:
                    backend.apply({"max_num_seqs": no_evict_batch(backend, figure)})
                comparison.max_num_seqs = backend.capacity()["max_num_seqs"]
                comparison.predicted = _banded(backend, figure.workload.replace(num_requests=n), figure.metric)
        except ValueError as e:  # the layout does not fit the hardware (ConfigError)
            comparison.error = str(e)
        rows.append(comparison.row())
    return rows
