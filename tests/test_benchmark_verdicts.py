"""The benchmarks' verdicts compare like with like, on a quiet machine, and a failed token check reaches the
exit code: figures from different devices (or unlike conditions) are refused, and so is a speed verdict when
the machine was busy at the start (a faked load average) or, in the contention benchmark, during a run; the
weight formats take turns round by round; a GPU check whose CUDA-graph tokens differ exits non-zero. The
throughput report: its options per model size, the load time and resident memory of an engine process (its
children included), and summary lines that each name the model, dtype, CPU and kernel tier. The what-if
report judges its capacity apart from the loads. All on the CPU; the one model run is tiny-llama's."""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import runner_core.kernels
from benchmarks import contention, gpu_check, machine, quant, quant_report, throughput, verdicts, whatif
from benchmarks.cuda_graphs import parity_exit_code
from benchmarks.engine_client import EngineProcess, EngineSpec, cache_state
from benchmarks.engine_proc import tree_rss_mib
from benchmarks.machine import bandwidth_probes, pool_probes
from benchmarks.summary import summary_lines
from benchmarks.throughput import parse_args, rounds
from benchmarks.verdicts import Figure, UnlikeFigures, ratio, verdict


def test_a_verdict_over_figures_from_different_devices_is_an_error_not_a_figure():
    engine = Figure(900.0, "cuda:0", "eager", "ours eager")  # e.g. GB/s of weights read on the GPU
    cpu_bandwidth = Figure(30.0, "cpu", label="sum probe")
    with pytest.raises(UnlikeFigures, match=r"ours eager \(cuda:0, eager\).*sum probe \(cpu\).*different devices"):
        verdict("batch-1 share", engine, cpu_bandwidth, 0.75, percent=True)
    with pytest.raises(UnlikeFigures, match="different devices"):
        ratio(Figure(1.0, "cpu", "eager", "ours"), Figure(1.0, "cuda:0", "eager", "vLLM"), like=False)
    line, r = verdict("batch-1 share", Figure(24.0, "cpu", "eager", "ours eager"), cpu_bandwidth, 0.75, percent=True)
    assert r == pytest.approx(0.8) and line == "batch-1 share: 80%; target >= 75%: met"


def test_eager_is_compared_with_eager_and_compiled_with_compiled_unless_labelled_an_extra():
    eager, compiled = Figure(600.0, "cpu", "eager", "ours eager"), Figure(700.0, "cpu", "compiled", "vllm compiled")
    with pytest.raises(UnlikeFigures, match="conditions differ"):
        verdict("ours / vLLM", eager, compiled, 1.25)
    cold = Figure(50.0, "cpu", "compiled, caches cold", "vLLM")
    with pytest.raises(UnlikeFigures, match="conditions differ"):
        ratio(Figure(2.0, "cpu", "compiled, caches warm", "ours"), cold)
    assert ratio(eager, compiled, like=False) == pytest.approx(600 / 700)
    line, _ = verdict("first token", Figure(5.0, "cpu", "compiled, caches cold", "ours"), cold, 0.2, at_least=False)
    assert line == "first token: 0.10x; target <= 0.20x: met"


def test_the_bandwidth_probes_report_each_method_with_its_median_and_range():
    probes = bandwidth_probes("cpu", calls=3, multiples=(1, 2))
    for method in ("sum", "copy"):
        p = probes[method]
        assert len(p["runs"]) == 6  # 3 calls at each of 2 sizes
        assert 0 < p["min"] <= p["median"] <= p["max"]
    assert probes["device"] == "cpu" and probes["sizes_mib"] == [probes["llc_mib"], 2 * probes["llc_mib"]]
    again = bandwidth_probes("cpu", calls=1, multiples=(1,))
    pooled = pool_probes([probes, again])
    for method in ("sum", "copy"):
        runs = probes[method]["runs"] + again[method]["runs"]
        assert pooled[method] == {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def test_cuda_graph_token_parity_reaches_the_exit_code(capsys):
    assert parity_exit_code({"eager": True, "compiled": True, "graphs": True}) == 0
    assert parity_exit_code({"eager": True, "compiled": True, "graphs": False}) == 1
    assert "greedy tokens of graphs differ from eager's" in capsys.readouterr().err


def _part(figures: dict, code: int) -> tuple[list[str], int]:
    return ["-c", f"import sys; print({json.dumps(json.dumps(figures))}); sys.exit({code})"], 60


@pytest.mark.parametrize("figures, code, failed", [
    ({"greedy_equal": {"eager": True, "graphs": True}}, 0, None),
    ({"greedy_equal": {"eager": True, "graphs": False}}, 0, "cuda_graphs: greedy tokens of graphs differ"),
    ({"greedy_equal": {"eager": True, "graphs": False}}, 1, "cuda_graphs: failed (exit 1)"),
])
def test_the_gpu_check_exits_non_zero_when_a_part_reports_unequal_tokens(figures, code, failed, capsys):
    parts = {"cuda_graphs": _part(figures, code), "parity": _part({"small-llama": {"flex": 4, "gather": 4}}, 0)}
    summary = {}
    assert gpu_check.check(parts, summary) == (1 if failed else 0)
    assert summary["parts"]["cuda_graphs"]["figures"] == figures
    if failed:
        assert any(f.startswith(failed) for f in summary["failures"])
        assert f"FAILED {failed}" in capsys.readouterr().out


def test_the_gpu_check_fails_when_parity_counts_fall_short_even_on_exit_0():
    summary = {}
    assert gpu_check.check({"parity": _part({"small-llama": {"flex": 4, "gather": 3}}, 0)}, summary) == 1
    assert summary["failures"] == ["parity: small-llama gather differ from transformers"]


def test_the_gpu_check_parses_its_arguments_and_every_check_refuses_without_cuda(monkeypatch, capsys):
    """On a machine without CUDA (this one) each check of `make gpu-check` stops before any work, with exit code
    2 and a message naming the check, CUDA and the fix; the orchestrator's arguments parse here."""
    from benchmarks import gpu_checks

    args = gpu_check.parse_args(["--part", "engine", "--out", "summary.json"])
    assert args.part == "engine" and args.out.name == "summary.json"
    assert set(gpu_check.PARTS) >= set(gpu_checks.CHECKS) | {"parity", "cuda_graphs"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in list(gpu_checks.CHECKS):
        monkeypatch.setitem(gpu_checks.CHECKS, name, functools.partial(pytest.fail, f"{name} ran without CUDA"))
        with pytest.raises(SystemExit) as stop:
            gpu_checks.run(name)
        said = capsys.readouterr().err
        assert stop.value.code == 2 and f"gpu check {name!r} needs CUDA" in said and "GPU_PYTHON" in said


def test_the_gpu_check_fails_a_part_whose_figures_say_it_failed():
    summary = {}
    assert gpu_check.check({"engine": _part({"ok": False, "why": "forward_s misses the GPU's time"}, 0)}, summary) == 1
    assert summary["failures"] == ["engine: forward_s misses the GPU's time"]


def test_a_start_records_whether_its_caches_were_cold_or_warm(tmp_path):
    assert cache_state(tmp_path / "start") == "cold (empty folders)"
    (tmp_path / "start" / "inductor").mkdir(parents=True)
    assert cache_state(tmp_path / "start") == "cold (empty folders)"
    (tmp_path / "start" / "inductor" / "fxgraph").write_text("x")
    assert cache_state(tmp_path / "start") == "warm (inductor)"



def test_an_engine_process_reports_its_start_settings_and_the_tokens_it_returned(tmp_path, tiny_llama_path):
    """ours eager through engine_proc.py on tiny-llama: ready before the first token, the batch limits
    and prefix-caching setting the driver asked for read back from the engine, tokens counted."""
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps([[[5, 6, 7], 4], [[8, 9], 2]]))
    args = SimpleNamespace(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
                           prefix_caching=True)
    proc = EngineProcess(EngineSpec("ours eager", "ours", False), str(tiny_llama_path), requests,
                         tmp_path / "cache", tmp_path / "engine.log", args, timeout=300)
    try:
        started = proc.started
        assert 0 < started["ready_s"] <= started["first_token_s"]
        assert started["device"] == "cpu" and proc.cache_state == "cold (empty folders)"
        assert started["settings"] == {"max_num_seqs": 4, "max_num_batched_tokens": 32, "prefix_caching": True}
        assert 0 < started["load_s"] < started["ready_s"]
        assert set(started["memory_mib"]) >= {"weights", "kv_pool"}
        assert started["rss_mib"] > started["memory_mib"]["weights"] + started["memory_mib"]["kv_pool"]
        res = proc.ask("workload")
        assert res["returned_tokens"] == 6 and [len(t) for t in res["tokens"]] == [4, 2]
    finally:
        proc.close()
    assert proc.proc.returncode is not None


def test_a_real_size_preset_runs_fewer_requests_one_engine_at_a_time_without_the_small_model_extras(capsys):
    small = parse_args([])
    assert (small.model, small.num_requests, small.skip_hf, small.skip_overhead, small.one_at_a_time) == \
        ("small-llama", 64, False, False, False)
    real = parse_args(["--model", "qwen2.5-0.5b", "--dtype", "bfloat16"])
    assert (real.num_requests, real.skip_hf, real.skip_overhead, real.one_at_a_time, real.dtype) == \
        (24, True, True, True, "bfloat16")
    asked = parse_args(["--model", "llama-3.2-1b", "--no-skip-hf", "--num-requests", "10", "--no-one-at-a-time"])
    assert (asked.num_requests, asked.skip_hf, asked.skip_overhead, asked.one_at_a_time) == (10, False, True, False)
    assert parse_args(["--model", "qwen2.5-0.5b", "--quick"]).num_requests == 8
    assert parse_args(["--skip-hf"]).skip_hf is True
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-gib", "0"])
    assert "--kv-cache-gib got 0; it must be >= 1" in capsys.readouterr().err


def test_the_resident_memory_of_an_engine_counts_its_child_processes():
    """vLLM's engine core is a child of the process the benchmark starts: its memory must be counted.
    Here a small parent whose child holds 256 MiB."""
    holder = "import sys; b = bytearray(256 << 20); print('ok', flush=True); sys.stdin.read()"
    parent = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdin=sys.stdin); "
              "c.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent, holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ok"
        own = int(Path(f"/proc/{proc.pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
        assert own < 128 and tree_rss_mib(proc.pid) >= own + 256
    finally:
        proc.stdin.close()
        proc.wait()


def test_the_whatif_capacity_has_a_verdict_of_its_own(capsys):
    """bench-whatif's capacity (a saturated burst, which the 30-85% loads never reach) is judged apart: with the
    figures of docs/whatif.md's run, capacity 6.06 requests/s measured and 4.94 simulated (18.4% under), it is
    missed while every load is met, in the printed table and in the JSON line's verdicts."""
    load = {"ttft": {"measured": 134.0, "simulated": 138.0, "error": 0.029}}
    workloads = {"workload": "48 requests", "capacity_rps": {"measured": 6.06, "simulated": 4.94, "error": 0.184},
                 "loads": {0.85: load}, "below_saturation": {"ttft": 0.028, "tpot": 0.076, "throughput": 0.012,
                                                               "max": 0.076, "loads": [0.3, 0.6]},
                 "near_saturation": {"ttft": 0.029, "tpot": 0.052, "throughput": 0.008, "max": 0.052, "loads": [0.85]}}
    steps = {"median_error": 0.079}
    assert whatif.TARGETS["capacity_error"] == 0.15
    assert whatif.verdicts(steps, workloads, {"seconds": 7.6}) == {
        "steps": "met", "capacity": "MISSED", "below_saturation": "met", "near_saturation": "met",
        "seconds_70b": "met"}
    whatif.workloads_table(workloads)
    assert "4.94 simulated ( 18.4%; target <= 15%: MISSED)" in capsys.readouterr().out
    workloads["capacity_rps"]["error"] = 0.10
    assert whatif.verdicts(steps, workloads)["capacity"] == "met"


def test_the_machine_line_names_the_kernel_tier_or_says_it_is_unknown(monkeypatch):
    monkeypatch.setattr(runner_core.kernels, "cpu_kernels_available", lambda: False)
    monkeypatch.delattr(runner_core.kernels, "kernel_tier", raising=False)
    info = machine.machine_info("cpu")
    assert info["kernel_tier"] == "unknown" and "kernel tier unknown" in machine.describe(info)
    monkeypatch.setattr(runner_core.kernels, "kernel_tier", lambda: "avx2", raising=False)
    info = machine.machine_info("cpu")
    assert machine.run_tag(info) == f"CPU {info['cpu_model']}, tier avx2"
    assert "kernel tier avx2" in machine.describe(info)


def test_every_summary_line_names_model_dtype_cpu_and_tier_with_ours_beside_vllm():
    tok_s = {"ours eager": {"median": 20.0}, "vllm eager": {"median": 16.0}, "ours compiled": {"median": 24.0}}
    batch1 = {"ours eager": {"median": 8.0}, "vllm eager": {"median": 6.4}}
    starts = {("ours eager", "eager"): {"load_s": 4.8, "rss_mib": 3994.4,
                                        "memory_mib": {"weights": 942.3, "panel_weights": 942.3, "kv_pool": 1024}},
              ("vllm eager", "eager"): {"load_s": 18.2, "rss_mib": 5120.0}}
    devices = dict.fromkeys(["ours eager", "vllm eager", "ours compiled"], "cpu")
    head = "[qwen2.5-0.5b, float32; CPU AMD EPYC 9B45, tier avx512-bf16]"
    lines = summary_lines("qwen2.5-0.5b", "float32", "CPU AMD EPYC 9B45, tier avx512-bf16", tok_s, batch1,
                          {"ours eager": 0.62, "vllm eager": None}, starts, devices)
    assert all(line.startswith(head + " ") for line in lines)
    assert [line[len(head) + 1:] for line in lines] == [
        "mixed workload, eager: ours 20.0 tok/s; vLLM 16.0 tok/s; ours/vLLM 1.25x",
        "batch-1 decode, eager: ours 8.0 tok/s (62% of the bandwidth); vLLM 6.4 tok/s; ours/vLLM 1.25x",
        "mixed workload, compiled: ours 24.0 tok/s; vLLM not measured; no ratio",
        "batch-1 decode, compiled: ours not measured; vLLM not measured; no ratio",
        "start, eager: ours load 4.8 s, RSS 3994 MiB (weights 942, panel_weights 942, kv_pool 1024 MiB); "
        "vLLM load 18.2 s, RSS 5120 MiB",
    ]


class _FakeEngine:
    """Replies as an engine process would: a workload of 3 tokens in 1 s, and the batch-1 timings given."""

    def __init__(self, one_s: float, many_s: float):
        self.batch1 = {"one_s": one_s, "many_s": many_s, "returned_tokens": 129}

    def ask(self, cmd: str) -> dict:
        return self.batch1 if cmd == "batch1" else {"seconds": 1.0, "returned_tokens": 3, "tokens": [[1, 2, 3]]}


def test_a_batch1_turn_where_129_tokens_took_no_longer_than_1_is_discarded_not_a_figure(capsys):
    procs = {"ours eager": _FakeEngine(0.1, 2.66), "vllm compiled": _FakeEngine(3.0, 2.5)}
    runs, _, batch1 = rounds(procs, {}, None, [], 1, {}, lambda: None)
    assert batch1 == {"ours eager": [pytest.approx(50.0)], "vllm compiled": []}
    assert runs["vllm compiled"] == [(1.0, 3)]
    assert "vllm compiled: batch-1 turn discarded (1 token 3.00 s, 129 tokens 2.50 s)" in capsys.readouterr().out


@pytest.mark.parametrize("one_at_a_time, most_alive", [(True, 1), (False, 3)])
def test_one_engine_at_a_time_never_holds_two_engines_and_measures_each(monkeypatch, one_at_a_time, most_alive):
    """At real sizes four engines' memory does not fit together: with one_at_a_time each engine is
    started, measured and closed before the next; together, all stay alive for interleaved rounds."""
    alive, seen = set(), []

    class Tracked(_FakeEngine):
        def __init__(self, name):
            super().__init__(0.1, 2.66)
            self.name, self.started = name, {"device": "cpu"}
            alive.add(name)
            seen.append(len(alive))

        def close(self):
            alive.discard(self.name)

    def start_engines(specs, model_dir, requests_file, tmp, args, errors):
        return {s.name: Tracked(s.name) for s in specs}, {(s.name, s.mode): {"load_s": 1.0} for s in specs}

    monkeypatch.setattr(throughput.engine_client, "start_engines", start_engines)
    specs = [s for s in throughput.SPECS if s.name != "vllm compiled"]
    args = SimpleNamespace(one_at_a_time=one_at_a_time, repeats=2)
    runs, tokens, batch1, starts, started = throughput.measure(specs, "m", None, None, args, {}, None, [], {},
                                                               lambda: None)
    assert max(seen) == most_alive and not alive
    assert set(runs) == set(batch1) == set(started) == {s.name for s in specs} and len(runs["ours eager"]) == 2


def test_an_engine_process_does_not_see_the_benchmark_modules_as_packages():
    """engine_proc.py runs as a script, with benchmarks/ first on sys.path: a sibling module there
    (machine.py, models.py, ...) could shadow a package of that name in a peer's venv (vLLM once failed to
    start when transformers imported a benchmarks/kernels.py as the `kernels` package)."""
    here = Path(throughput.__file__).parent
    probe = (f"import importlib.util, runpy, sys; sys.path.insert(0, {str(here)!r}); "
             f"runpy.run_path({str(here / 'engine_proc.py')!r}, run_name='engine_proc'); "
             "print(importlib.util.find_spec('machine'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def _load(monkeypatch, load: float, cores: int = 2) -> verdicts.Quiet:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.4, 0.3))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    return verdicts.quiet_at_start()


def test_a_speed_verdict_is_refused_when_the_machine_was_not_quiet_at_its_start(monkeypatch):
    busy = _load(monkeypatch, 1.6)  # other sessions on a 2-core machine
    assert busy.as_dict() == {"load_1min": 1.6, "cores": 2, "limit": 1.0, "quiet": False}
    idle, beside = Figure(100.0, "cpu", label="idle"), Figure(60.0, "cpu", label="beside a busy process")
    line, r = verdict("busy / idle", beside, idle, 0.5, quiet=busy)
    assert r == pytest.approx(0.6)
    assert line == "busy / idle: 0.60x; target >= 0.50x: refused: machine not quiet (load 1.60 on 2 cores)"
    quiet = _load(monkeypatch, 0.9)
    assert quiet.ok and verdict("busy / idle", beside, idle, 0.5, quiet=quiet)[0].endswith("target >= 0.50x: met")
    assert _load(monkeypatch, 3.9, cores=8).ok and not _load(monkeypatch, 4.5, cores=8).ok  # half a process a core
    # contention: quiet at the start, but other processes kept 1.3 of the 2 cores busy during a run
    runs = [{"idle_others_cores": 0.1, "busy_others_cores": 0.2}, {"idle_others_cores": 1.3, "busy_others_cores": 0.0}]
    assert contention.busy_over_idle_verdict(0.6, quiet, runs[:1]) == "met"
    assert contention.busy_over_idle_verdict(0.4, quiet, runs[:1]) == "NOT met"
    assert contention.busy_over_idle_verdict(0.6, quiet, runs) == \
        "refused: machine not quiet (load 1.30 on 2 cores during round 2's idle run)"
    assert contention.busy_over_idle_verdict(0.6, busy, runs[:1]).startswith("refused: machine not quiet (load 1.60")
    # the weight formats: the speed targets refused, memory judged all the same
    row = {"rss_mib": 900.0, "peak_rss_mib": 1000.0, "weights_mib": 500.0, "kv_pool_mib": 256.0,
           "bandwidth_share": {"median": 0.8}, "batch1_tok_s": {"median": 10.0}, "mixed_tok_s": {"median": 40.0}}
    rows = {"none": row, "int8": {**row, "batch1_tok_s": {"median": 20.0}, "mixed_tok_s": {"median": 50.0}}}
    lines = quant_report.model_targets("small-llama", rows, busy)
    assert [line.split(": ")[0] for line in lines] == ["met", "met", "refused", "met", "met", "refused", "refused"]
    assert lines[-1] == ("refused: machine not quiet (load 1.60 on 2 cores): small-llama int8: mixed workload 1.25x "
                         "our float32 (>= 1x)")
    assert [line.split(": ")[0] for line in quant_report.model_targets("small-llama", rows, quiet)] == ["met"] * 7


class _FormatProcess:
    """One weight format's process as quant.py sees it: started, asked for batch-1 and mixed turns, closed."""

    def __init__(self, fmt: str, log: list, alive: set, dense_bytes: int, quality: bool):
        self.fmt, self.log, self.alive = fmt, log, alive
        self.started = {"dense_bytes": dense_bytes, "quality_measured": quality}
        alive.add(fmt)
        log.append(("start", fmt, len(alive), quality))

    def ask(self, cmd: str) -> dict:
        self.log.append((cmd, self.fmt))
        return {"one_s": 0.1, "many_s": 1.1} if cmd == "batch1" else {"seconds": 1.0, "returned_tokens": 10}

    def close(self) -> None:
        self.alive.discard(self.fmt)


@pytest.mark.parametrize("dense_bytes", [2 << 30, 1 << 20])
def test_the_weight_formats_take_turns_round_by_round(monkeypatch, tiny_llama_path, dense_bytes):
    """A model over 1 GiB (one process alive at a time) and a small one (all alive): in every round each
    format takes a turn, the order rotated a place a round, each timed batch-1 turn after a bandwidth probe;
    never one format's rounds and then the next's."""
    log, alive = [], set()
    monkeypatch.setattr(quant, "start_ours", lambda fmt, model_dir, tmp, args, errors, quality=True:
                        _FormatProcess(fmt, log, alive, dense_bytes, quality))
    probe = {m: {"median": 10.0, "min": 10.0, "max": 10.0, "runs": [10.0]} for m in ("sum", "copy")}
    monkeypatch.setattr(quant.machine, "bandwidth_probes", lambda *a, **k: log.append(("probe",)) or probe)
    args = quant.parse_args(["--formats", "none", "int8", "int4-g64", "--mixed-formats", "int8", "--repeats", "3",
                             "--no-llamacpp"])
    figures = quant.run_model(str(tiny_llama_path), args, errors := {})
    assert not errors and not alive
    timed = [log[i + 1][1] for i, e in enumerate(log) if e == ("probe",)]
    rounds = [["none", "int8", "int4-g64"], ["int8", "int4-g64", "none"], ["int4-g64", "none", "int8"]]
    batch1 = [e[1] for e in log if e[0] == "batch1"]
    if dense_bytes > quant.ONE_AT_A_TIME_BYTES:
        assert [e[1] for e in log if e[0] == "start"] == ["none", *[f for r in rounds for f in r]]
        assert all(e[2] == 1 for e in log if e[0] == "start")  # one process alive at a time
        # quality measured once per format: the reference's first start, each other format's first turn
        assert [e[1] for e in log if e[0] == "start" and e[3]] == ["none", "int8", "int4-g64"]
        assert timed == [f for r in rounds for f in r]  # each turn: a probe just before its timed batch-1
        assert batch1 == [f for r in rounds for f in r for _ in (0, 1)]  # an untimed turn first, each start
    else:
        assert [e[1:3] for e in log if e[0] == "start"] == [("none", 1), ("int8", 2), ("int4-g64", 3)]
        assert log.count(("probe",)) == 3  # one a round
        assert batch1 == ["none", "int8", "int4-g64", *[f for r in rounds for f in r]]  # untimed turns, then rounds
    assert figures["starts"]["int8"]["quality_measured"]
    assert {name: len(t["batch1"]) for name, t in figures["timings"].items()} == dict.fromkeys(rounds[0], 3)
    assert len(figures["timings"]["int8"]["mixed"]) == 3 and figures["timings"]["none"]["mixed"] == []
