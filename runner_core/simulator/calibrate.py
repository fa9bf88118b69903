"""This CPU's cost-model coefficients, fitted to the real engine's measured steps.

`measure_cpu()` gives the CPU's HardwareSpec: the best matmul rate per dtype on square matrices (1024 and 2048, the
larger skipped where the smaller is already slow; torch.mm and the native panel GEMM, the engine's linears) and
the read bandwidth of a sum over a 256 MiB buffer (past any last-level cache), both on the threads the engine's
steps use, and the machine's RAM. Its link figures are placeholders, never priced: one process has no collective
(tensor and pipeline parallel sizes of 1), so the latency is 0 and the "link" is a copy within RAM (the measured
bandwidth).

`calibrate()` runs the real engine (ModelRunner, eager, the default scheduler, a fixed thread count) over a
`ShapeSweep`: pure prefills of several prompt lengths, then for each KV length K a batch of requests with
K-token prompts prefilled (prefill and mixed steps), decoded D rows at a time (D descending: the extra requests
are aborted), and at each D prompts of a few chunk sizes added while the rows decode (mixed steps). Every step's
record (`StepMetrics.batch_shape`, sampled rows, `total_s`) is a row; the median over the repeats of each
distinct shape is kept. The coefficients are the NNLS fit of `CostModel.features` on the rows of two model
depths (so per-layer and per-step fixed costs separate), refitted until each step's compute/memory bound
settles. `FIT_SHAPES` and `HELD_OUT_SHAPES` share no D, K or chunk size: `measure_steps` on the latter gives
the rows `validate.validate_steps` scores.

The result is saved as JSON (`$RUNNER_WORKBENCH_CACHE/whatif/calibration.json`) and read by
`load_calibration()`, which `Simulation(hardware="cpu")` uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import random
import statistics
import time

import torch

from runner_core.config import TORCH_DTYPES
from runner_core.engine.threads import usable_cores
from runner_core.host import cpu_model_name, cpu_tier
from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear, panels_support
from runner_core.loader.model_loader import read_hf_config, resolve_model_path
from runner_core.memory.shapes import ModelShape
from runner_core.model_runner import ModelRunner
from runner_core.sampling_params import SamplingParams
from runner_core.simulator.calibration import Calibration, calibration_path, load_calibration  # noqa: F401 (API)
from runner_core.simulator.cost_model import CostModel
from runner_core.simulator.fit import fit_coefficients
from runner_core.simulator.hardware import Coefficients, HardwareSpec

_MiB = 2**20
PEAK_SIZES = (1024, 2048)
BANDWIDTH_BYTES = 256 * _MiB
# the settings every calibration run takes; cpu_threads is added (the usable cores, fixed: the adaptive
# thread count would time some steps on fewer threads)
ENGINE_SETTINGS = {"max_model_len": 2048, "kv_cache_memory": 512 * _MiB, "enforce_eager": True}
_START = Coefficients(compute_efficiency=0.5, memory_efficiency=0.5, attention_efficiency=0.5,
                      decode_attention_efficiency=0.5, step_s=0.0, layer_s=0.0, seq_s=0.0)
_MAX_REFITS = 8
START_RATIOS = (1.0, 0.3, 0.1, 0.03, 0.01)  # compute / memory efficiency of the fit's starting points


# ---- the CPU's peaks ----------------------------------------------------------------------------
@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _matmul_peak(dtype: torch.dtype, calls: int = 3) -> float:
    """FLOP/s of the fastest matmul the engine can use on square matrices: torch.mm, and runner_core's panel GEMM
    where the native kernels run `dtype` (on some CPUs it beats torch.mm twice over). A path whose first call
    takes over a second is not repeated, and 2048 is skipped after a 1024 call over 0.2 s (a CPU without native
    bfloat16 takes minutes there)."""
    panels = cpu_kernels_available() and panels_support(dtype)
    best = 0.0
    for n in PEAK_SIZES:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        paths = [functools.partial(torch.mm, a, b)]
        if panels:
            paths.append(functools.partial(panel_linear, a, pack_panels(b.t().contiguous()), n, None))
        slow = False
        for fn in paths:
            first = _seconds(fn)
            fastest = first if first > 1.0 else min(_seconds(fn) for _ in range(calls))
            best, slow = max(best, 2 * n**3 / fastest), slow or first > 0.2
        if slow:
            break
    return best


def _read_bandwidth(calls: int = 5) -> float:
    """Bytes/s of the fastest sum over a float32 buffer of BANDWIDTH_BYTES (read once per call)."""
    x = torch.ones(BANDWIDTH_BYTES // 4)
    x.sum()
    return BANDWIDTH_BYTES / min(_seconds(x.sum) for _ in range(calls))


def measure_cpu(threads: int | None = None) -> HardwareSpec:
    """This CPU as a HardwareSpec (kind "cpu"), measured on `threads` threads (default: the usable cores, as the
    engine's steps run). Takes seconds."""
    threads = threads or usable_cores()[0]
    with _torch_threads(threads):
        peaks = {name: _matmul_peak(TORCH_DTYPES[name]) for name in ("float32", "bfloat16")}
        bandwidth = _read_bandwidth()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    how = f"measured by runner_core.simulator.calibrate.measure_cpu on {threads} threads"
    return HardwareSpec(
        name=f"cpu:{cpu_model_name()} ({cpu_tier()})", kind="cpu", memory_bytes=ram, peak_flops=peaks,
        mem_bandwidth=bandwidth, link_bandwidth=bandwidth, link_latency_s=0.0, devices_per_node=1, reserved_bytes=0,
        sources={"peak_flops": f"{how}: fastest torch.mm or panel GEMM, square {'/'.join(map(str, PEAK_SIZES))}",
                 "mem_bandwidth": f"{how}: fastest sum over a {BANDWIDTH_BYTES // _MiB} MiB float32 buffer",
                 "memory_bytes": "physical RAM (sysconf)",
                 "link_bandwidth": "not priced: one process has no collective (tp = pp = 1); a copy within RAM",
                 "link_latency_s": "not priced: one process has no collective (tp = pp = 1)"})


# ---- the step shapes ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShapeSweep:
    """The steps a calibration run makes: pure prefills of `prefills` tokens (longer than the token budget:
    chunked), and for each KV length in `contexts`, the `decodes` row counts (descending, at most
    `max_prefill_tokens` of prompts per context) decoding `decode_steps` steps each, with a prompt of each of
    `chunks` tokens added to them (mixed steps)."""

    contexts: tuple[int, ...]
    decodes: tuple[int, ...]
    prefills: tuple[int, ...]
    chunks: tuple[int, ...]
    decode_steps: int = 3
    max_prefill_tokens: int = 8192

    def decodes_at(self, context: int) -> list[int]:
        """The row counts run at `context`, largest first (at least the smallest one)."""
        fitting = [d for d in self.decodes if d * context <= self.max_prefill_tokens]
        return sorted(fitting or [min(self.decodes)], reverse=True)


# the fit's decode batches include what the engine runs under load (20-40 rows at KV lengths of a few hundred),
# each with chunks added (mixed steps); 64 rows only at the shortest context (the prefill it takes stays small)
FIT_SHAPES = ShapeSweep(contexts=(16, 160, 512), decodes=(1, 2, 4, 8, 16, 20, 32, 40, 64),
                        prefills=(32, 128, 512, 1024), chunks=(16, 64, 256))
HELD_OUT_SHAPES = ShapeSweep(contexts=(64, 256, 1000), decodes=(3, 6, 12, 24, 48), prefills=(48, 200, 320, 768),
                             chunks=(24, 100, 400))


def _drain(runner) -> None:
    while runner.has_unfinished_requests():
        runner.step()


def _run_sweep(runner, sweep: ShapeSweep, rng: random.Random) -> None:
    engine = runner.engine
    vocab = engine.vocab_size

    def add(n: int, max_tokens: int) -> str:
        return runner.add_request([rng.randrange(3, vocab) for _ in range(n)],
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    for n in sweep.prefills:
        add(n, 1)
        _drain(runner)
    for context in sweep.contexts:
        rows = sweep.decodes_at(context)
        ids = [add(context, engine.max_model_len - context) for _ in range(rows[0])]  # aborted before they end
        while any(engine.requests[i].num_output_tokens == 0 for i in ids):
            runner.step()
        for d in rows:
            for rid in ids[d:]:
                runner.abort_request(rid)
            ids = ids[:d]
            for _ in range(sweep.decode_steps):
                runner.step()
            for chunk in sweep.chunks:
                rid = add(chunk, 1)
                while rid in engine.requests:
                    runner.step()
        for rid in ids:
            runner.abort_request(rid)


def measure_steps(runner, sweep: ShapeSweep, *, repeats: int = 3, seed: int = 0,
                  model: str | None = None) -> list[dict]:
    """Rows of the real steps `runner` (loaded, idle) makes over `sweep`, `repeats` times (fresh prompts each
    time, so no prefix is ever cached): {"model", "starts", "num_new_tokens", "num_sampled", "seconds" (the
    median of the repeats' total_s), "runs"}, one per distinct shape."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    model = model or runner.config.model
    observer = runner.engine.observer
    _run_sweep(runner, ShapeSweep(contexts=(16,), decodes=(2,), prefills=(16,), chunks=(8,)),
               random.Random(f"warm-{seed}"))  # first-call costs (allocations, kernel selection) stay out
    times: dict[tuple, list[float]] = {}
    for r in range(repeats):
        before = observer.num_steps
        _run_sweep(runner, sweep, random.Random(f"{seed}-{r}"))
        made = observer.num_steps - before
        if made > observer.records.maxlen:
            raise ValueError(f"the sweep made {made} steps, more than the {observer.records.maxlen} the engine "
                             "keeps; use fewer shapes")
        for m in list(observer.records)[-made:] if made else []:
            key = (tuple(m.batch_shape[0]), tuple(m.batch_shape[1]), m.num_sampled)
            times.setdefault(key, []).append(m.total_s)
    return [{"model": model, "starts": list(s), "num_new_tokens": list(n), "num_sampled": k,
             "seconds": statistics.median(t), "runs": len(t)} for (s, n, k), t in times.items()]


# ---- the calibration -----------------------------------------------------------------------------------
def cost_models(rows: list[dict], hardware: HardwareSpec, coefficients: Coefficients, dtype: str) -> dict:
    """{model: CostModel} for the models of `rows`."""
    shapes = {r["model"] for r in rows}
    return {m: CostModel(ModelShape.from_hf_config(read_hf_config(resolve_model_path(m, weights=False))), hardware,
                         coefficients, dtype=dtype) for m in sorted(shapes)}


def predict(models: dict, row: dict) -> float:
    """The cost model's step time of `row` (a measured row's shape)."""
    return models[row["model"]].step_time(row["starts"], row["num_new_tokens"], row["num_sampled"])


def relative_errors(models: dict, rows: list[dict]) -> dict:
    """{"median_error", "p90_error", "n"} of |predicted - measured| / measured over `rows`."""
    errors = sorted(abs(predict(models, r) - r["seconds"]) / r["seconds"] for r in rows)
    if not errors:
        raise ValueError("no rows to score: measure some steps first (measure_steps)")
    return {"median_error": statistics.median(errors), "p90_error": errors[min(len(errors) - 1,
                                                                                int(0.9 * len(errors)))],
            "n": len(errors)}


def _rms_error(models: dict, rows: list[dict]) -> float:
    """The fit's objective: the root mean square of the rows' relative errors."""
    return statistics.fmean(((predict(models, r) - r["seconds"]) / r["seconds"]) ** 2 for r in rows) ** 0.5


def fit_rows(rows: list[dict], hardware: HardwareSpec, dtype: str) -> tuple[Coefficients, dict]:
    """(coefficients, {model: CostModel with them}) fitted to `rows`. Which rows count as compute- or
    memory-bound depends on the coefficients, so the fit alternates: classify by the current coefficients,
    fit, classify again, until the classes stop changing, from starting points of several compute / memory
    efficiency ratios (the ridge between the two bounds moves with them); the best fit (least RMS relative
    error) wins. A ValueError from the fit ends that start (a class it emptied leaves an efficiency
    undetermined); when every start ends so, the first start's error is raised."""
    base, best, first_error = cost_models(rows, hardware, _START, dtype), None, None
    for ratio in START_RATIOS:
        start = dataclasses.replace(_START, compute_efficiency=ratio * _START.memory_efficiency)
        models, last = {m: cm.with_coefficients(start) for m, cm in base.items()}, None
        for _ in range(_MAX_REFITS):
            features = [(models[r["model"]].features(r["starts"], r["num_new_tokens"], r["num_sampled"]),
                         r["seconds"]) for r in rows]
            if features == last:
                break
            try:
                coefficients = fit_coefficients(features)
            except ValueError as e:
                first_error = first_error or e
                break
            last, models = features, {m: cm.with_coefficients(coefficients) for m, cm in base.items()}
            score = _rms_error(models, rows)
            if best is None or score < best[0]:
                best = (score, coefficients, models)
    if best is None:
        raise first_error
    return best[1], best[2]


def calibration_settings(threads: int | None = None) -> dict:
    """The engine settings of a calibration's runs (and of the real runs validation compares with)."""
    return {**ENGINE_SETTINGS, "cpu_threads": threads or usable_cores()[0]}


def calibrate(model: str = "small-llama", *, dtype: str | None = None, shapes: ShapeSweep | None = None,
              repeats: int = 3, save: bool = True, models=None, path=None, threads: int | None = None,
              progress=None) -> Calibration:
    """Measure this CPU (`measure_cpu`) and the real engine's steps over `shapes` (default FIT_SHAPES) on `model`
    and on each of `models` (default: `model` and tiny-llama, two depths), fit the cost model's coefficients and
    return (and with `save`, write to `path`, default calibration_path()) the Calibration. `dtype` None: the
    dtype the engine picks for `model` ("auto"). `progress(message)` hears of each stage."""
    say = progress or (lambda message: None)
    start = time.perf_counter()
    models = list(dict.fromkeys([model, *(models if models is not None else ["tiny-llama"])]))
    settings = calibration_settings(threads)
    hardware = measure_cpu(settings["cpu_threads"])
    say(f"{hardware.name}: float32 {hardware.peak_flops['float32'] / 1e9:.0f} GFLOP/s, bfloat16 "
        f"{hardware.peak_flops['bfloat16'] / 1e9:.0f} GFLOP/s, read {hardware.mem_bandwidth / 1e9:.1f} GB/s")
    rows = []
    for name in models:
        t = time.perf_counter()
        with ModelRunner({"model": name, "dtype": dtype or "auto", **settings}).load_model() as runner:
            dtype = runner.model_info()["dtype"]
            rows += measure_steps(runner, shapes or FIT_SHAPES, repeats=repeats, model=name)
        say(f"{name} ({dtype}): {sum(r['model'] == name for r in rows)} step shapes in {time.perf_counter() - t:.0f} s")
    coefficients, fitted = fit_rows(rows, hardware, dtype)
    calibration = Calibration(
        hardware=dataclasses.replace(hardware, efficiency=coefficients), model=model, dtype=dtype,
        rows=rows, fit_error={**relative_errors(fitted, rows),
                              "by_model": {m: relative_errors(fitted, [r for r in rows if r["model"] == m])
                                           for m in models}},
        models=models, settings=settings, date=datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"), seconds=time.perf_counter() - start)
    if save:
        calibration.save(path)
    return calibration
