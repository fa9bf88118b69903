"""The staged sweep: stage order and best choice, the recommendation and its ties, the Pareto frontier,
a results file that resumes after an interrupt (and refuses rows of another machine or commit), overhead
accounting (a fake backend with synthetic, deterministic figures), the default space from the KV capacity,
and one small real sweep on tiny-llama through RunnerBackend with live scheduler knobs."""

from __future__ import annotations

import json
import re
import threading
import types
from collections import Counter

import pytest

from runner_core.host import machine_name, source_commit
from runner_core.tuning import Arrivals, Lengths, RunResult, Target, Workload
from runner_core.tuning import sweep as sweep_module
from runner_core.tuning.space import SweepSpace, held_concurrency, knob_groups, propose_space
from runner_core.tuning.sweep import RunnerBackend, TuneBackend, tune

WORKLOAD = Workload(num_requests=16, prompt_len=Lengths.fixed(32), output_len=Lengths.fixed(16))
TARGET = Target("tpot_p99_ms", 100.0)
SPACE = SweepSpace(concurrency=[1, 2, 4, 8, 16], scheduler={"max_num_seqs": [4, 8], "block_size": [16, 32]},
                   engine={"compile": [True]})


class FakeBackend:
    """Synthetic figures: with e = min(concurrency, max_num_seqs), throughput = 100 e^0.8 and TPOT =
    10 e ms, so a target of 100 ms holds up to e = 10; compile makes both 10% better; block_size does
    nothing; each repeat's seed moves the figures by -1%, 0 or +1%."""

    def __init__(self, clock=None):
        self.current = {"max_num_seqs": 256, "block_size": 16, "compile": False}
        self.measured = Counter()  # (settings, seed) -> recorded runs
        self.applies = 0
        self.clock = clock

    def apply(self, settings):
        if settings.get("max_num_seqs", 1) < 1:
            raise ValueError("config field 'max_num_seqs' got 0")
        self.applies += 1
        if self.clock:
            self.clock.now += 0.5
        self.current.update(settings)
        return {"seconds": 0.5, "rebuilt": "scheduler"}

    def capacity(self):
        return {"kv_tokens": 1024, "block_size": 16, "max_model_len": 256, "max_num_seqs": 256}

    def settings(self):
        return dict(self.current)

    def run(self, workload, target):
        if self.clock:
            self.clock.now += 1.0
        if workload.seed < sweep_module.WARMUP_SEED_OFFSET:
            self.measured[(json.dumps(self.current, sort_keys=True), workload.arrivals.concurrency,
                           workload.seed)] += 1
        e = min(workload.arrivals.concurrency or workload.num_requests, self.current["max_num_seqs"])
        scale = (1 + 0.01 * (workload.seed % 3 - 1)) * (1.1 if self.current["compile"] else 1.0)
        tpot = 10.0 * e / scale
        summary = {"completed": workload.num_requests, "output_throughput": 100.0 * e ** 0.8 * scale,
                   "tpot_p99_ms": tpot, "tokens_per_s_per_user": 1000.0 / tpot, "target_met": tpot <= target.limit}
        return RunResult([], summary, workload, dict(self.current))


def _by_label(result):
    return {p["label"]: p for p in result.points}


def test_stages_build_on_the_best_point_and_the_recommendation_names_it():
    backend = FakeBackend()
    assert isinstance(backend, TuneBackend)
    result = tune(SPACE, WORKLOAD, TARGET, backend=backend, repeats=3, warmup=1)
    assert not result.cancelled and len(result.rows) == 3 * len(result.points)
    stages = [p["stage"] for p in result.points]
    assert stages == sorted(stages, key=["layout", "concurrency", "scheduler", "engine"].index)
    # concurrency 8 is the most throughput with p99 TPOT (80 ms) under 100 ms; 16 (160 ms) fails
    points = _by_label(result)
    assert points["concurrency=16"]["met"] is False and points["concurrency=8"]["met"] is True
    # the scheduler stage is a grid (2 x 2 <= 8) on top of concurrency 8; the engine stage on top of its best
    assert result.plan["scheduler"] == "grid of 4 points"
    scheduler = [p for p in result.points if p["stage"] == "scheduler"]
    assert len(scheduler) == 4 and all(p["settings"]["concurrency"] == 8 for p in scheduler)
    engine = [p for p in result.points if p["stage"] == "engine"]
    assert [p["settings"]["compile"] for p in engine] == [True]
    assert engine[0]["settings"]["concurrency"] == 8
    rec = result.recommendation
    assert rec["met"] and rec["settings"] == engine[0]["settings"]
    assert rec["value"] == pytest.approx(80 / 1.1) and rec["margin"] == pytest.approx(1 - 0.8 / 1.1)
    assert rec["worst_margin"] == pytest.approx(1 - 0.8 / 1.1 / 0.99)  # the slowest repeat's p99
    assert rec["throughput"] == pytest.approx(100 * 8 ** 0.8 * 1.1)
    # each row holds the settings as applied: the scheduler rows ran with their max_num_seqs
    assert {(r["max_num_seqs"], r["block_size"]) for r in result.rows if r["stage"] == "scheduler"} == {
        (4, 16), (4, 32), (8, 16), (8, 32)}
    frame = result.dataframe()
    assert len(frame) == len(result.rows)
    assert {"stage", "repeat", "concurrency", "max_num_seqs", "output_throughput", "apply_seconds"} <= set(frame)
    assert list(result.points_dataframe()["label"]) == [p["label"] for p in result.points]


def test_ties_are_the_points_within_the_best_ones_repeat_range():
    # without compile, the best is concurrency 8; max_num_seqs 8 and block size 32 change nothing: ties
    space = SweepSpace(concurrency=[4, 8, 16], scheduler={"max_num_seqs": [4, 8], "block_size": [16, 32]})
    result = tune(space, WORKLOAD, TARGET, backend=FakeBackend(), repeats=3, warmup=0)
    rec = result.recommendation
    assert rec["settings"] == {"concurrency": 8}
    ties = sorted(json.dumps(t, sort_keys=True) for t in rec["ties"])
    assert ties == sorted(json.dumps({"concurrency": 8, "max_num_seqs": 8, "block_size": b}, sort_keys=True)
                          for b in (16, 32))
    # the points with max_num_seqs 4 run at half the throughput: no tie
    assert not any(t.get("max_num_seqs") == 4 for t in rec["ties"])


def test_knobs_one_at_a_time_when_the_grid_is_too_big():
    knobs = {"max_num_seqs": [2, 4, 8], "block_size": [16, 32], "max_num_batched_tokens": [64, 128]}
    assert [len(g) for g in knob_groups(knobs)] == [3, 2, 2]
    space = SweepSpace(concurrency=[8], scheduler={"max_num_seqs": [2, 4, 8], "block_size": [16, 32, 64]})
    result = tune(space, WORKLOAD, TARGET, backend=FakeBackend(), repeats=1, warmup=0)
    assert result.plan["scheduler"] == "one knob at a time (6 points)"
    block = [p["settings"] for p in result.points if "block_size" in p["settings"]]
    # the block sizes are tried on top of the best max_num_seqs (8 ties the incumbent, which stays);
    # block size 16 is the incumbent's own: its point is reused, not measured again
    assert block == [{"concurrency": 8, "block_size": b} for b in (32, 64)]
    assert len(result.points) == 6 and len(result.rows) == 6


def test_no_point_meets_the_target_the_closest_is_recommended_and_says_so():
    result = tune(SweepSpace(concurrency=[1, 2, 4]), WORKLOAD, Target("tpot_p99_ms", 5.0),
                  backend=FakeBackend(), repeats=3, warmup=0)
    rec = result.recommendation
    assert rec["met"] is False and rec["settings"] == {"concurrency": 1}
    assert rec["margin"] == pytest.approx(-1.0)
    assert "no point met tpot_p99_ms <= 5" in result.why and "100% over" in result.why


def test_the_frontier_keeps_exactly_the_undominated_points():
    result = tune(SPACE, WORKLOAD, TARGET, backend=FakeBackend(), repeats=3, warmup=0)
    key = ("tokens_per_s_per_user", "output_throughput")

    def beats(a, b):
        return all(a[k] >= b[k] for k in key) and any(a[k] > b[k] for k in key)

    medians = [{**p["median"], "label": p["label"]} for p in result.points]
    on = {f["label"] for f in result.frontier}
    for p in medians:
        assert (p["label"] in on) == (not any(beats(q, p) for q in medians))
    # compile beats the same settings without it on both axes
    assert "concurrency=8" not in on and "concurrency=8 compile=True" in on
    assert [f["output_throughput"] for f in result.frontier] == sorted(f["output_throughput"] for f in result.frontier)


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_an_interrupted_sweep_resumes_from_its_results_file(tmp_path, suffix):
    path = tmp_path / f"sweep{suffix}"
    stop = threading.Event()
    backend = FakeBackend()

    seen = []

    def stop_after_7(progress):
        seen.append(progress)
        if len(seen) == 7:
            stop.set()

    first = tune(SPACE, WORKLOAD, TARGET, backend=backend, repeats=3, warmup=1, results=path,
                 on_progress=stop_after_7, stop=stop)
    assert first.cancelled and len(first.rows) == 7  # stopped between repeats, mid-point
    assert len(path.read_text().splitlines()) == 7 + (suffix == ".csv")
    resumed = tune(SPACE, WORKLOAD, TARGET, backend=backend, repeats=3, warmup=1, results=path)
    assert not resumed.cancelled
    assert max(backend.measured.values()) == 1  # no point x repeat measured twice
    assert resumed.timings["resumed_repeats"] == 7
    whole = tune(SPACE, WORKLOAD, TARGET, backend=FakeBackend(), repeats=3, warmup=1)
    columns = ("key", "stage", "label", "repeat", "concurrency", "max_num_seqs", "output_throughput", "tpot_p99_ms")
    assert [[r[c] for c in columns] for r in resumed.rows] == [[r[c] for c in columns] for r in whole.rows]
    assert resumed.recommendation["settings"] == whole.recommendation["settings"]
    # a torn last line (killed mid-write) is cut off and its repeat measured again
    text = path.read_text()
    path.write_text(text + text.splitlines()[-1][:10])
    again = tune(SPACE, WORKLOAD, TARGET, backend=backend, repeats=3, warmup=1, results=path)
    assert again.timings["measured_repeats"] == 0 and len(again.rows) == len(whole.rows)


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_rows_of_another_machine_or_commit_are_refused_not_resumed(tmp_path, monkeypatch, suffix):
    path, space = tmp_path / f"sweep{suffix}", SweepSpace(concurrency=[1, 2])
    monkeypatch.setattr(sweep_module, "source_commit", lambda: "1234567890" * 4)  # a commit that reads as a number
    first = tune(space, WORKLOAD, TARGET, backend=FakeBackend(), repeats=1, warmup=0, results=path)
    here = {"machine": machine_name(), "commit": "1234567890" * 4}
    assert [{k: r[k] for k in here} for r in first.rows] == [here, here]
    resumed = tune(space, WORKLOAD, TARGET, backend=FakeBackend(), repeats=1, warmup=0, results=path)
    assert resumed.timings["resumed_repeats"] == 2 and resumed.timings["measured_repeats"] == 0

    backend = FakeBackend()
    monkeypatch.setattr(sweep_module, "source_commit", lambda: "f" * 40)
    with pytest.raises(ValueError, match=rf"{path.name} holds rows measured on another machine or commit: commit "
                                         rf"'{'1234567890' * 4}' \(this run: '{'f' * 40}'\)\. Resuming would mix.*"
                                         "pass a new results path, or delete the file"):
        tune(space, WORKLOAD, TARGET, backend=backend, repeats=1, warmup=0, results=path)
    monkeypatch.setattr(sweep_module, "source_commit", lambda: "1234567890" * 4)
    monkeypatch.setattr(sweep_module, "machine_name", lambda: "Other CPU (avx2)")
    with pytest.raises(ValueError, match=rf"machine '{re.escape(machine_name())}' \(this run: 'Other CPU \(avx2\)'\)"):
        tune(space, WORKLOAD, TARGET, backend=backend, repeats=1, warmup=0, results=path)
    assert not backend.measured and backend.applies == 0  # refused before anything ran
    assert len(path.read_text().splitlines()) == 2 + (suffix == ".csv")  # and nothing appended


def test_a_results_file_whose_rows_name_no_machine_is_refused(tmp_path):
    """Rows written before rows named their machine and commit: their provenance is unknown."""
    assert re.fullmatch(r"[0-9a-f]{40}", source_commit())  # this checkout's commit
    path = tmp_path / "sweep.json"
    tune(SweepSpace(concurrency=[1]), WORKLOAD, TARGET, backend=FakeBackend(), repeats=1, warmup=0, results=path)
    row = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in row.items() if k not in ("machine", "commit")}) + "\n")
    with pytest.raises(ValueError, match=rf"machine 'not recorded' \(this run: '{re.escape(machine_name())}'\); commit "
                                         rf"'not recorded' \(this run: '{source_commit()}'\)"):
        tune(SweepSpace(concurrency=[1]), WORKLOAD, TARGET, backend=FakeBackend(), repeats=1, warmup=0, results=path)


def test_overhead_is_the_wall_time_outside_the_backends_runs(monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(sweep_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    backend = FakeBackend(clock)
    progress = []
    result = tune(SweepSpace(concurrency=[2, 4], scheduler={"max_num_seqs": [2]}), WORKLOAD, TARGET,
                  backend=backend, repeats=3, warmup=1, on_progress=progress.append)
    runs = 3 * 3 + 3  # 3 points x (3 repeats + 1 warm-up)
    assert backend.applies == 4  # 3 points, then max_num_seqs put back as the sweep found it
    assert backend.current["max_num_seqs"] == 256
    assert result.timings["run_s"] == 9.0 and result.timings["warmup_s"] == 3.0 and result.timings["apply_s"] == 2.0
    assert result.overhead == pytest.approx(2.0 / (2.0 + runs))
    assert [p.points_done for p in progress] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    # the first repeat took 2.5 s of wall (apply, warm-up, run): 8 repeats left
    assert progress[0].eta_s == pytest.approx(2.5 * 8) and progress[-1].eta_s == 0
    assert progress[-1].overhead == pytest.approx(1.5 / (1.5 + runs))  # before the settings were put back


def test_a_refused_combination_is_skipped_with_the_reason():
    result = tune(SweepSpace(concurrency=[4], scheduler={"max_num_seqs": [0, 2]}), WORKLOAD, TARGET,
                  backend=FakeBackend(), repeats=1, warmup=0)
    assert [s["settings"] for s in result.skipped] == [{"concurrency": 4, "max_num_seqs": 0}]
    assert "max_num_seqs" in result.skipped[0]["why"]
    assert [p["label"] for p in result.points] == ["concurrency=4", "concurrency=4 max_num_seqs=2"]


def test_the_proposed_space_follows_the_kv_capacity():
    workload = Workload(num_requests=64, prompt_len=Lengths.uniform(16, 48), output_len=Lengths.fixed(64))
    # a request holds 32 + 64 / 2 = 64 tokens on average: 4 blocks of 16; 1024 tokens hold 16 at once
    capacity = {"kv_tokens": 1024, "block_size": 16, "max_model_len": 256, "max_num_seqs": 256}
    assert held_concurrency(capacity, workload) == 16
    space = propose_space(capacity, workload)
    assert space.concurrency == [1, 2, 4, 8, 16, 24]  # powers of two up to 1.5 x 16
    assert space.scheduler["max_num_seqs"] == [12, 24]
    assert space.scheduler["max_num_batched_tokens"] == [32, 64, 128]  # P = 32 rounded to 16, 2P, 4P, >= 24
    assert space.scheduler["block_size"] == [16, 32] and space.engine == {"compile": [False, True]}
    # a pool holding more than the workload sends stops at num_requests
    assert propose_space({**capacity, "kv_tokens": 1 << 20}, workload).concurrency[-1] == 64
    with pytest.raises(ValueError, match="needs capacity keys"):
        propose_space({"kv_tokens": 1024}, workload)


def test_bad_spaces_and_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="concurrency is its own stage"):
        SweepSpace(scheduler={"concurrency": [1, 2]})
    with pytest.raises(ValueError, match="non-empty list of ints"):
        SweepSpace(concurrency=[0])
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        tune(SPACE, WORKLOAD, TARGET, backend=FakeBackend(), repeats=0)
    with pytest.raises(ValueError, match=r"backend has no settings \['dtype'\]"):
        tune(SweepSpace(concurrency=[1], engine={"dtype": ["bfloat16"]}), WORKLOAD, TARGET, backend=FakeBackend())
    with pytest.raises(ValueError, match="use a .csv or .json"):
        tune(SPACE, WORKLOAD, TARGET, backend=FakeBackend(), results="sweep.txt")


class RecordingBackend(RunnerBackend):
    """RunnerBackend noting, at each recorded run, the runner object and its scheduler's max_num_seqs."""

    def __init__(self, config):
        super().__init__(config)
        self.seen = []

    def run(self, workload, target):
        if workload.seed < sweep_module.WARMUP_SEED_OFFSET:
            self.seen.append((self.runner, self.runner.engine.scheduler.max_num_seqs))
        return super().run(workload, target)


def test_a_real_sweep_on_tiny_llama_applies_scheduler_knobs_live(tiny_llama_path):
    workload = Workload(num_requests=4, arrivals=Arrivals.burst(), prompt_len=Lengths.fixed(8),
                        output_len=Lengths.fixed(6))
    with RecordingBackend({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}) as backend:
        runner = backend.runner
        assert backend.capacity()["kv_tokens"] == runner.memory_stats()["blocks_total"] * 16
        result = tune(SweepSpace(concurrency=[1, 4], scheduler={"max_num_seqs": [2, 3]}), workload,
                      Target("tpot_p99_ms", 60_000.0), backend=backend, repeats=3, warmup=1)
    assert len(result.rows) == 12 and all(r["completed"] == 4 for r in result.rows)
    assert [r["concurrency"] for r in result.rows[:6]] == [1, 1, 1, 4, 4, 4]
    scheduler = [r for r in result.rows if r["stage"] == "scheduler"]
    assert [r["max_num_seqs"] for r in scheduler] == [2, 2, 2, 3, 3, 3]
    # the engine really ran with each point's max_num_seqs, on the one runner loaded at the start
    assert [m for _, m in backend.seen] == [r["max_num_seqs"] for r in result.rows]
    assert all(r is runner for r, _ in backend.seen)
    assert {r["rebuilt"] for r in scheduler} == {"scheduler"}
    assert result.recommendation["met"] and result.recommendation["settings"]["concurrency"] in (1, 4)


def test_a_run_cut_short_by_cancel_is_not_recorded_nor_resumed(tmp_path):
    """Cancelling stops the run in flight (its requests are aborted): what it measured is not a
    repeat, so it is neither a row nor a line of the results file a resumed sweep would reuse."""
    path, stop = tmp_path / "sweep.csv", threading.Event()

    class CancelledMidRun(FakeBackend):
        def run(self, workload, target):
            result = super().run(workload, target)
            if workload.seed < sweep_module.WARMUP_SEED_OFFSET and sum(self.measured.values()) == 4:
                stop.set()  # the user pressed Cancel while the 4th repeat ran
            return result

    cut = tune(SPACE, WORKLOAD, TARGET, backend=CancelledMidRun(), repeats=3, warmup=0, results=path, stop=stop)
    assert cut.cancelled and len(cut.rows) == 3
    assert len(path.read_text().splitlines()) == 1 + 3
    resumed = tune(SPACE, WORKLOAD, TARGET, backend=FakeBackend(), repeats=3, warmup=0, results=path)
    assert resumed.timings["resumed_repeats"] == 3
    assert len(path.read_text().splitlines()) == 1 + len(resumed.rows)  # the cut repeat measured once, in full


def test_csv_keys_that_look_like_numbers_are_read_back_as_written(tmp_path):
    from runner_core.tuning.results import ResultsFile

    path = tmp_path / "rows.csv"
    rows = [{"key": key, "repeat": 0, "label": "concurrency=1", "stage": "concurrency", "rebuilt": "none",
             "output_throughput": 1.5} for key in ("1234567890123456", "12e4567890123456", "0000000000000001")]
    file = ResultsFile(path)
    for row in rows:
        file.append(row)
    loaded = ResultsFile(path).load()
    assert sorted(k for k, _ in loaded) == sorted(r["key"] for r in rows)
    assert loaded[("12e4567890123456", 0)]["output_throughput"] == 1.5
