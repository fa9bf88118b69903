"""Published GPU serving figures kept out of the simulator's development: `HELD_OUT`, from sources other than the
TensorRT-LLM performance pages the simulator was developed against (`published.PUBLISHED`), and
`held_out_error`, the error of the typical prediction on them. Nothing is fitted or tuned to these figures; their
settings follow rules fixed before they were first simulated:

* what the source states is used as stated (engine, model, weight format, GPUs, tensor parallelism, input and
  output lengths, concurrency);
* what it does not state takes this simulator's default (the KV cache in the compute dtype, RunnerConfig's batch
  limits, no overlap scheduler, this engine's admission), as a user with only the source would run it;
* a fixed-concurrency run has 2 x concurrency requests (the source's request count is unstated).

Sources looked at and not used, and why: vLLM's and SGLang's performance blog posts (2024-09-05 "vLLM v0.6.0",
lmsys.org 2024-07-25 "SGLang Llama3") give their figures as charts only; MLPerf Inference Llama-2-70B Offline
results (e.g. v4.1, 8x H200: 31,302.7 tokens/s, 107.477 samples/s, TP1, batch 806, FP8) state no input-length
distribution beyond its 1,024-token cap, and the throughput of a compute-bound offline run depends on it.
"""

from __future__ import annotations

import statistics

from runner_core.simulator.published import UNSTATED, PublishedFigure, compare_published
from runner_core.tuning.workload import Arrivals, Lengths, Workload

_NIM = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance.md"
_NIM_HOW = ("NIM 1.8.0 container for Llama-3.3-70B-Instruct, measured with AIPerf against its OpenAI-compatible "
            "server at a fixed concurrency, 'Throughput(Tokens/s)': output tokens/s (a reading: at concurrency 250, "
            "500 tokens x 93.2 ms ITL + 88.6 s TTFT per request gives 250 / 135 s x 500 = 925 tokens/s, the "
            "published 920)")
_UNSTATED = {"kv_cache_dtype": UNSTATED, "max_num_seqs": UNSTATED, "max_num_batched_tokens": UNSTATED}
_UNSTATED_ENGINE = {"async_scheduling": UNSTATED + " (not overlapped)", "no_evict": UNSTATED + " (this engine's)"}


def _nim_70b(concurrency: int, value: float) -> PublishedFigure:
    workload = Workload(num_requests=2 * concurrency, arrivals=Arrivals.fixed_concurrency(concurrency),
                        prompt_len=Lengths.fixed(5000), output_len=Lengths.fixed(500))
    return PublishedFigure(
        name=f"nim1.8-llama3.3-70b-fp8-h100-tp2-5000-500-c{concurrency}", source=_NIM, engine="NVIDIA NIM 1.8.0",
        published_model="meta/llama-3.3-70b-instruct (NIM fp8 TP2 profile)", model="llama-3-70b",
        hardware="h100-sxm", tensor_parallel_size=2, weight_format="fp8", workload=workload,
        metric="output_throughput", value=value, setting_sources=dict(_UNSTATED),
        engine_sources=dict(_UNSTATED_ENGINE), notes=f"{_NIM_HOW}. Concurrency {concurrency} as stated.")


HELD_OUT: list[PublishedFigure] = [
    _nim_70b(50, 814.37),
    _nim_70b(100, 917.26),
]


def held_out_error(rows: list[dict] | None = None) -> dict:
    """The typical prediction's error on the held-out figures (`rows` from compare_published(figures=HELD_OUT),
    run when None): {"figures", "inside" (published within the band), "median_error" and "max_error"
    (|typical / published - 1|), "ratios" (typical / published, by figure)}."""
    rows = compare_published(figures=HELD_OUT) if rows is None else rows
    done = [r for r in rows if r["error"] is None]
    errors = [abs(r["ratio"] - 1) for r in done]
    return {"figures": len(rows), "inside": sum(bool(r["inside"]) for r in done),
            "median_error": statistics.median(errors) if errors else None, "max_error": max(errors, default=None),
            "ratios": {r["figure"]: r["ratio"] for r in done}}
