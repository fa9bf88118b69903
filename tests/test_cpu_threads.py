"""The engine's CPU thread count (engine/threads.py): usable cores (affinity, cgroup quota), the adaptive
choice from step timings and its re-checks, an explicit setting winning, bad settings refused, model_info reporting it,
and greedy tokens unchanged while it adapts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.engine import threads
from runner_core.engine.threads import ThreadTuner, cgroup_cpu_limit, explicit_threads, usable_cores
from runner_core.errors import ConfigError


@pytest.fixture(autouse=True)
def keep_torch_threads(monkeypatch):
    monkeypatch.delenv(threads.ENV_THREADS, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line)
    return root, proc


def test_cgroup_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/user.slice/job\n", {
        "cpu.max": "max 100000\n", "user.slice/cpu.max": "150000 100000\n", "user.slice/job/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert usable_cores({0, 1, 2, 3}, cgroup_cpu_limit(root, proc)) == (1, "4 in this process's CPU affinity, "
                                                                           "cgroup quota 1.5 CPUs")


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    root, proc = _cgroup(tmp_path, "5:memory:/x\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, proc) == 3.0
    unlimited, proc = _cgroup(tmp_path / "u", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(unlimited, proc) is None


def test_usable_cores_never_exceed_affinity_or_quota():
    assert usable_cores({0, 1}, None)[0] == 2
    assert usable_cores({0, 1}, 8.0)[0] == 2  # a quota above the affinity does not add cores
    assert usable_cores({0, 1, 2, 3, 4, 5, 6, 7}, 2.5)[0] == 2
    assert usable_cores({3}, 0.5)[0] == 1  # at least one


class FakeTorch:
    """torch's thread count and a clock, for a tuner driven with given step timings."""

    def __init__(self, count: int):
        self.count, self.now, self.sets = count, 0.0, []

    def set(self, n: int) -> None:
        self.count = n
        self.sets.append(n)

    def tuner(self, usable: int, **kw) -> ThreadTuner:
        return ThreadTuner(usable, "test", set_threads=self.set, get_threads=lambda: self.count,
                           clock=lambda: self.now, **kw)

    def steps(self, tuner: ThreadTuner, per_token: dict[int, float], n: int, tokens: int = 8,
              prompt: bool = False) -> list[bool]:
        changed = []
        for _ in range(n):
            tuner.before_step()
            self.now += 0.01
            changed.append(tuner.after_step(tokens, prompt, tokens * per_token[self.count]))
        return changed


def test_adaptive_picks_the_faster_count_and_follows_a_change_of_load():
    fake = FakeTorch(2)
    tuner = fake.tuner(2)
    assert tuner.info()["policy"] == "adaptive" and tuner.candidates == [2, 1]
    assert any(fake.steps(tuner, {2: 1e-3, 1: 2e-3}, 8))  # idle: two threads twice as fast
    assert tuner.count == 2 and not tuner.exploring and "2 threads ran 2.00x as fast" in tuner.why
    assert set(fake.sets) == {1, 2}  # both counts ran real steps
    fake.steps(tuner, {2: 1e-3, 1: 2e-3}, 20)
    assert tuner.count == 2 and not tuner.exploring  # steady: no re-check before its time
    # a busy neighbour: two threads now wait at every barrier; the drift starts a re-check
    fake.steps(tuner, {2: 20e-3, 1: 2.5e-3}, 16 + 8)
    assert tuner.count == 1 and tuner.info()["count"] == 1 and "1 thread ran 8.00x" in tuner.why
    fake.steps(tuner, {2: 20e-3, 1: 2.5e-3}, 5)
    assert fake.count == 1


def test_occasional_slow_steps_do_not_start_a_recheck():
    """A step that lost a time slice is noise; step time that stays away from the measured one is not."""
    fake = FakeTorch(2)
    tuner = fake.tuner(2, recheck_s=1e9)
    fake.steps(tuner, {2: 1e-3, 1: 2e-3}, 8)
    for _ in range(10):  # every fourth step five times slower
        fake.steps(tuner, {2: 1e-3, 1: 2e-3}, 3)
        fake.steps(tuner, {2: 5e-3, 1: 10e-3}, 1)
    assert not tuner.exploring and tuner.decisions == 1
    fake.steps(tuner, {2: 3e-3, 1: 2e-3}, 16 + 8)  # two threads now a third of their speed: a re-check
    assert tuner.decisions == 2 and tuner.count == 1


def test_recheck_after_its_interval_which_grows_while_the_choice_holds():
    fake = FakeTorch(2)
    tuner = fake.tuner(2, recheck_s=5.0, max_recheck_s=20.0)
    timings = {2: 1e-3, 1: 3e-3}
    fake.steps(tuner, timings, 8)
    assert tuner.decisions == 1 and tuner.recheck_s == 5.0
    for expected in (10.0, 20.0, 20.0):
        fake.now += tuner.recheck_s + 1
        fake.steps(tuner, timings, 1)
        assert tuner.exploring  # the interval passed: every count is timed again
        fake.steps(tuner, timings, 8)
        assert not tuner.exploring and tuner.count == 2 and tuner.recheck_s == expected


def test_steps_are_compared_like_with_like():
    """A prompt step that only one count ran says nothing about the counts: it is not compared."""
    fake = FakeTorch(2)
    tuner = fake.tuner(2)
    fake.steps(tuner, {2: 1.0, 1: 1.0}, 1, tokens=200, prompt=True)  # slow per token, at 2 threads only
    fake.steps(tuner, {2: 1e-3, 1: 4e-3}, 7)
    assert tuner.count == 2 and "over the last 5 timed steps" in tuner.why


def test_candidates_halve_down_to_one():
    assert threads.candidate_counts(8) == [8, 4, 2, 1]
    assert threads.candidate_counts(6) == [6, 3, 1]
    assert threads.candidate_counts(1) == [1]
    assert not FakeTorch(1).tuner(1).adaptive  # one core: nothing to choose


def test_explicit_setting_wins(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: (2, "two cores (test)"))
    cpu = torch.device("cpu")
    monkeypatch.setenv(threads.ENV_THREADS, "1")
    assert explicit_threads(None) == (1, threads.ENV_THREADS)
    assert explicit_threads(3) == (3, "cpu_threads in the config")  # the config beats the environment
    tuner = ThreadTuner.for_engine(3, cpu, 1)
    assert tuner.info()["policy"] == "fixed" and tuner.count == 3 and "more than the 2 usable" in tuner.why
    tuner.before_step()
    assert torch.get_num_threads() == 3
    monkeypatch.setenv(threads.ENV_THREADS, "auto")
    assert ThreadTuner.for_engine(None, cpu, 1).adaptive
    parallel = ThreadTuner.for_engine(None, cpu, 2)  # the supervisor's per-rank count is left alone
    parallel.before_step()
    assert parallel.count is None and torch.get_num_threads() == 3 and "parallel runner" in parallel.why


@pytest.mark.parametrize("raw", ["two", "0", "-1", "1.5"])
def test_bad_environment_value_is_refused(monkeypatch, raw):
    monkeypatch.setenv(threads.ENV_THREADS, raw)
    with pytest.raises(ConfigError, match=rf"RUNNER_CORE_THREADS='{raw}'.*an int >= 1.*fix or unset it"):
        explicit_threads(None)


@pytest.mark.parametrize("user_env, first, spincount, policy", [
    ({}, "", "0", "passive"),  # runner_core first: waiting threads sleep
    ({"OMP_WAIT_POLICY": "active"}, "", "30000000000", "active"),  # the user's choice stands
    ({}, "import torch; ", "300000", "torch was loaded before runner_core: set OMP_WAIT_POLICY=passive"),
])
def test_openmp_threads_wait_passively_unless_the_user_chose(user_env, first, spincount, policy):
    """What libgomp itself read when torch loaded (its verbose environment display), and what
    model_info's threads report says."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user_env, OMP_DISPLAY_ENV="verbose")
    code = first + "import runner_core.engine.threads as t; print(t.wait_policy())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert re.search(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr).group(1) == spincount
    assert policy in run.stdout


def test_bad_config_value_is_refused():
    with pytest.raises(ConfigError, match="'cpu_threads' got 0; allowed: an int >= 1 or None"):
        ModelRunner({"model": "tiny-llama", "cpu_threads": 0})


def test_model_info_reports_a_fixed_count(tiny_llama_path):
    torch.set_num_threads(2)
    with ModelRunner({"model": str(tiny_llama_path), "device": "cpu", "dtype": "float32", "cpu_threads": 1,
                      "kv_cache_memory": 4 << 20}).load_model() as runner:
        runner.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        info = runner.model_info()["threads"]
        assert (info["count"], info["policy"], info["why"]) == (1, "fixed", "set by cpu_threads in the config")
        assert info["usable_cores"] >= 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2  # shutdown gives torch its count back


def test_adaptive_engine_gives_the_same_greedy_tokens(tiny_llama_path, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: (2, "two cores (test)"))
    cfg = {"model": str(tiny_llama_path), "device": "cpu", "dtype": "float32", "kv_cache_memory": 4 << 20}
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with ModelRunner(cfg, cpu_threads=1).load_model() as fixed:
        expected = [o.token_ids for o in fixed.generate(prompts, params)]
    with ModelRunner(cfg).load_model() as runner:
        tuner = runner.engine.threads
        seen = []
        tuner._set = lambda n: (seen.append(n), torch.set_num_threads(n))
        assert runner.model_info()["threads"]["policy"] == "adaptive"
        assert [o.token_ids for o in runner.generate(prompts, params)] == expected
        assert set(seen) == {1, 2}  # steps really ran at both counts
        info = runner.model_info()["threads"]
        assert tuner.decisions >= 1 and info["count"] == tuner.count and " as fast per token as " in info["why"]


def test_both_dashboards_show_the_thread_choice(tiny_llama_path):
    from workbench import Session
    from workbench.views.panel_app import SessionDashboard
    from workbench.views.widgets import SessionWidgets

    session = Session()
    try:
        session.load_model(str(tiny_llama_path), name="tiny", dtype="float32", kv_cache_memory=4 << 20, cpu_threads=1)
        line = "CPU threads: 1 of "
        widgets = SessionWidgets(session, auto_refresh=False)
        widgets.refresh()
        shown = widgets.models_text.value
        assert line in shown and "fixed (set by cpu_threads in the config)" in shown
        dashboard = SessionDashboard(session)
        dashboard.refresh()
        assert line in dashboard.models_text.object
        widgets.close()
    finally:
        session.close()
