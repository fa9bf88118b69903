"""How far the calibrated simulation is from the real engine on this machine.

* `validate_steps`: the cost model's step times against measured ones on shapes the fit never saw
  (calibrate.HELD_OUT_SHAPES measured by calibrate.measure_steps), overall and by step kind (decode only,
  prefill only, mixed).
* `validate_workloads`: serving figures of the real runner against the simulated one. Capacity is the real
  engine's saturated request rate (requests/s of a burst of the workload, the median of the repeats); at each
  load a Poisson workload at load x capacity runs on the real runner (wall clock) and on the simulated one
  (the calibration's spec, the same engine settings, model and seed; virtual clock), the two taking turns each
  repeat. Per load: the median TTFT, median TPOT and output throughput measured (median of the repeats),
  simulated, and the relative error; the errors are summarised below saturation (loads < 0.8) and near it.
"""

from __future__ import annotations

import statistics

from runner_core.model_runner import ModelRunner
from runner_core.simulator.calibrate import Calibration, cost_models, relative_errors
from runner_core.simulator.runner import SimulatedRunner
from runner_core.simulator.simulation import Simulation
from runner_core.tuning.driver import run_workload
from runner_core.tuning.workload import Arrivals, Lengths, Workload

FIGURES = {"ttft": "ttft_p50_ms", "tpot": "tpot_p50_ms", "throughput": "output_throughput"}
NEAR_SATURATION = 0.8  # loads at or above this are "near saturation"


def step_kind(row: dict) -> str:
    """"decode" (every sequence runs one token), "prefill" (none does) or "mixed"."""
    decodes = sum(n == 1 for n in row["num_new_tokens"])
    return "decode" if decodes == len(row["num_new_tokens"]) else "prefill" if decodes == 0 else "mixed"


def validate_steps(calibration: Calibration, held_out: list[dict]) -> dict:
    """{"median_error", "p90_error", "n", "by_kind": {kind: the same}} of the calibration's predicted step
    times against the measured `held_out` rows (calibrate.measure_steps rows)."""
    models = cost_models(held_out, calibration.hardware, calibration.coefficients, calibration.dtype)
    kinds = sorted({step_kind(r) for r in held_out})
    return {**relative_errors(models, held_out),
            "by_kind": {k: relative_errors(models, [r for r in held_out if step_kind(r) == k]) for k in kinds}}


def default_workload(num_requests: int = 48, seed: int = 0) -> Workload:
    """The validation's requests: prompts of 32-256 tokens, 16-96 output tokens (greedy, EOS ignored)."""
    return Workload(num_requests=num_requests, prompt_len=Lengths.uniform(32, 256), output_len=Lengths.uniform(16, 96),
                    seed=seed)


def _error(measured: float | None, simulated: float | None) -> float | None:
    return abs(simulated - measured) / measured if measured and simulated is not None else None


def _summary(per_load: dict, loads) -> dict:
    """The largest error of each figure over `loads` (and over all figures: "max")."""
    out = {name: max((per_load[x][name]["error"] for x in loads if per_load[x][name]["error"] is not None),
                     default=None) for name in FIGURES}
    present = [e for e in out.values() if e is not None]
    return {**out, "max": max(present) if present else None, "loads": list(loads)}


def validate_workloads(calibration: Calibration, model: str | None = None, *, loads=(0.3, 0.6, 0.85),
                       num_requests: int = 48, repeats: int = 3, workload: Workload | None = None,
                       progress=None) -> dict:
    """Real against simulated serving of `model` (default: the calibration's) at each of `loads` (fractions of
    the real engine's measured capacity); see the module docstring. Returns {"capacity_rps": {"measured",
    "simulated", "error"}, "loads": {load: {figure: {"measured", "simulated", "error"}}}, "below_saturation",
    "near_saturation": the largest error of each figure there, "workload": its label, "settings"}."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not loads or any(not 0 < x < 1.5 for x in loads):
        raise ValueError(f"loads must be fractions of capacity in (0, 1.5), got {loads!r}")
    say = progress or (lambda message: None)
    base = (workload or default_workload(num_requests)).replace(arrivals=Arrivals.burst())
    settings = {"model": model or calibration.model, "dtype": calibration.dtype, **calibration.settings}
    real = ModelRunner(settings).load_model()
    sim = SimulatedRunner(settings, Simulation(hardware=calibration.hardware)).load_model()
    try:
        run_workload(real, base.replace(num_requests=min(8, base.num_requests), seed=base.seed + 1000))  # warm-up
        bursts = {"measured": [], "simulated": []}
        for _ in range(repeats):
            bursts["measured"].append(run_workload(real, base).summary["request_throughput"])
            bursts["simulated"].append(run_workload(sim, base).summary["request_throughput"])
        capacity = {k: statistics.median(v) for k, v in bursts.items()}
        capacity["error"] = _error(capacity["measured"], capacity["simulated"])
        say(f"capacity {capacity['measured']:.2f} requests/s measured, {capacity['simulated']:.2f} simulated")
        runs = {x: {"measured": [], "simulated": []} for x in loads}
        for r in range(repeats):
            for x in loads:
                w = base.replace(arrivals=Arrivals.poisson(x * capacity["measured"]))
                runs[x]["measured"].append(run_workload(real, w).summary)
                runs[x]["simulated"].append(run_workload(sim, w).summary)
                say(f"round {r + 1}, load {x:.0%}: " + ", ".join(
                    f"{name} {runs[x]['measured'][-1][key]:.4g} vs {runs[x]['simulated'][-1][key]:.4g}"
                    for name, key in FIGURES.items()))
    finally:
        real.shutdown()
        sim.shutdown()
    per_load = {}
    for x in loads:
        per_load[x] = {}
        for name, key in FIGURES.items():
            measured, simulated = (statistics.median([s[key] for s in runs[x][side] if s[key] is not None] or [0.0])
                                   for side in ("measured", "simulated"))
            per_load[x][name] = {"measured": measured, "simulated": simulated, "error": _error(measured, simulated)}
    below = [x for x in loads if x < NEAR_SATURATION]
    near = [x for x in loads if x >= NEAR_SATURATION]
    return {"capacity_rps": capacity, "loads": per_load, "below_saturation": _summary(per_load, below),
            "near_saturation": _summary(per_load, near), "workload": base.label, "settings": settings}
