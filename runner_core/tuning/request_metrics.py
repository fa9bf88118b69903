"""A load run's summary (percentiles, throughput, goodput under a latency target) over its requests'
RequestMetrics, with the definitions of vLLM's serving benchmark (`vllm bench serve`); each request's TTFT,
TPOT, ITLs and E2E are RequestMetrics' (runner_core/engine/sequence.py), defined there only.

Percentiles are numpy's linear interpolation (vLLM's). Goodput is vLLM's request goodput: completed
requests meeting every SLO threshold, per second; a request with one output token has TPOT 0 there, as in
vLLM. Input and output token counts are over completed requests only (as vLLM's).

Where ours differs from vLLM's: a request's arrival is when the client submitted it (in process: when the
driver or the session handed it in, which may be later than it was due), and E2E ends when the request
finished (over HTTP: when its stream closed; vLLM's ends at the last chunk); engine-side records
(`side="engine"`, the in-process and session drivers) hold no network or HTTP framing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from runner_core.engine.sequence import RequestMetrics
from runner_core.tuning.workload import Workload

STAT_METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def _slo_for(metric: str, limit: float) -> dict[str, float]:
    kind = metric.split("_", 1)[0]
    return {"ttft_ms": limit} if kind == "ttft" else {"e2e_ms": limit} if kind == "e2e" else {"tpot_ms": limit}


@dataclass(frozen=True)
class Target:
    """The latency target of a run or sweep: `metric` (a summary key such as "tpot_p99_ms") must stay
    <= `limit`. `slo` holds the per-request goodput thresholds ({"ttft_ms", "tpot_ms", "e2e_ms"});
    by default the one matching the metric (an ITL metric uses the request's TPOT, its mean gap)."""

    metric: str = "tpot_p99_ms"
    limit: float = 100.0
    slo: dict[str, float] | None = None

    def __post_init__(self) -> None:
        allowed = [f"{m}_{s}_ms" for m in STAT_METRICS for s in STATS]
        if self.metric not in allowed:
            raise ValueError(f"Target.metric {self.metric!r} is unknown; use one of {', '.join(allowed)}")
        if not isinstance(self.limit, (int, float)) or isinstance(self.limit, bool) \
                or not 0 < self.limit < math.inf:
            raise ValueError(f"Target.limit must be a number of milliseconds > 0, got {self.limit!r}")
        slo = _slo_for(self.metric, float(self.limit)) if self.slo is None else dict(self.slo)
        for key, value in slo.items():
            if key not in SLO_KEYS:
                raise ValueError(f"Target.slo key {key!r} is unknown; use {', '.join(SLO_KEYS)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Target.slo[{key!r}] must be milliseconds > 0, got {value!r}")
        object.__setattr__(self, "slo", slo)

    def value(self, summary: dict) -> float | None:
        return summary.get(self.metric)

    def met(self, summary: dict) -> bool:
        value = self.value(summary)
        return value is not None and value <= self.limit

    def margin(self, summary: dict) -> float:
        """(limit - value) / limit: the share of the limit left (negative when missed; -inf without a value)."""
        value = self.value(summary)
        return -math.inf if value is None else (self.limit - value) / self.limit

    def good(self, record: RequestMetrics) -> bool:
        """Whether one completed request meets every SLO threshold."""
        got = {"ttft_ms": record.ttft, "tpot_ms": record.tpot or 0.0, "e2e_ms": record.e2e}
        return record.ok and all(got[k] is not None and 1e3 * got[k] <= v for k, v in self.slo.items())

    @property
    def label(self) -> str:
        return f"{self.metric} <= {self.limit:g}"


def _stats(name: str, seconds: list[float]) -> dict:
    if not seconds:
        return {f"{name}_{s}_ms": None for s in STATS}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {f"{name}_mean_ms": float(ms.mean()), f"{name}_p50_ms": float(p50), f"{name}_p90_ms": float(p90),
            f"{name}_p99_ms": float(p99)}


def summarize(records: list[RequestMetrics], duration_s: float, target: Target | None = None) -> dict:
    """The run's figures: counts, throughputs (per second of `duration_s`), TTFT/TPOT/ITL/E2E mean
    and p50/p90/p99 in ms, tokens/s per user (the median over requests of 1/TPOT), goodput under
    `target` (None without one) and whether the target is met."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    done = [r for r in records if r.ok]
    tpots = [r.tpot for r in done if r.tpot is not None]
    inputs, outputs = sum(r.num_prompt_tokens for r in done), sum(r.num_output_tokens for r in done)
    out = {"num_requests": len(records), "completed": len(done), "failed": len(records) - len(done),
           "duration_s": duration_s, "input_tokens": inputs, "output_tokens": outputs,
           "request_throughput": len(done) / duration_s, "output_throughput": outputs / duration_s,
           "total_token_throughput": (inputs + outputs) / duration_s,
           "tokens_per_s_per_user": float(np.median([1 / t for t in tpots if t > 0])) if any(
               t > 0 for t in tpots) else None}
    out.update(_stats("ttft", [r.ttft for r in done if r.ttft is not None]))
    out.update(_stats("tpot", tpots))
    out.update(_stats("itl", [g for r in done for g in r.itls]))
    out.update(_stats("e2e", [r.e2e for r in done]))
    good = None if target is None else sum(target.good(r) for r in done)
    out["goodput"] = None if good is None else good / duration_s
    out["goodput_fraction"] = None if good is None or not records else good / len(records)
    out["target_met"] = None if target is None else target.met(out)
    return out


@dataclass
class RunResult:
    """One load run: its requests' RequestMetrics (in the workload's order), their summary, the workload sent
    and the engine settings it ran with."""

    records: list[RequestMetrics]
    summary: dict
    workload: Workload
    settings: dict = field(default_factory=dict)
