"""Feedback on long work: progress bars for the weight load, each compile size (moving while one
size compiles, not stuck at 0) and the native kernel build; the torch FutureWarning a cold
AOTInductor compile prints, which a user cannot act on, is not shown (and only that one)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from runner_core import RunnerConfig
from runner_core.compile import aoti_program
from runner_core.compile.compile_optimizer import CompileOptimizer
from runner_core.loader.weight_utils import SafetensorsWeights
from tests.conftest import REPO

WAIT_S = 60.0  # how long a fake step waits for the bar's refreshes before the test gives up


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, so tqdm draws (it stays silent on pipes and logs)."""

    def isatty(self) -> bool:
        return True


def terminal(monkeypatch) -> Terminal:
    """Replace sys.stderr for the rest of the test (inside the test: pytest's capture resets it
    between a fixture's setup and the test's call)."""
    out = Terminal()
    monkeypatch.setattr(sys, "stderr", out)
    return out


def _wait_for(predicate) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_weight_load_shows_tensors_read(tiny_llama_path, monkeypatch):
    stderr = terminal(monkeypatch)
    weights = SafetensorsWeights(tiny_llama_path)
    n = weights.num_tensors()
    assert n > 5
    assert sum(1 for _ in weights) == n
    out = stderr.getvalue()
    assert f"Loading weights (1 file):   0%|          | 0/{n} [" in out and "tensor/s" in out
    assert out.endswith("\r"), "the bar goes once the weights are in (leave=False)"


def test_compile_progress_names_each_size_and_moves_while_one_compiles(tiny_llama_path, monkeypatch):
    from transformers import AutoConfig

    stderr = terminal(monkeypatch)
    config = RunnerConfig.coerce({"model": str(tiny_llama_path), "compile": True})
    optimizer = CompileOptimizer.create(config, AutoConfig.from_pretrained(tiny_llama_path))
    seen = {}

    def run(n):  # a compile of size n: waits until the bar has been redrawn while it runs
        start = len(stderr.getvalue())
        seen[n] = _wait_for(lambda: stderr.getvalue()[start:].count(f"compiling for {n} tokens") >= 2)

    optimizer._run_sizes(run, [1, 4])
    assert seen == {1: True, 4: True}, "the bar is redrawn while one size compiles"
    out = stderr.getvalue()
    assert "0/2" in out and "1/2" in out and "2/2" in out
    assert "1 tokens: " in out and "4 tokens: " in out, "the bar ends with each size's seconds"
    assert set(optimizer.compile_seconds) == {1, 4}


def test_kernel_build_shows_a_bar_with_its_elapsed_time(tmp_path):
    # a subprocess: this one may have loaded the kernels already (then nothing is built)
    script = textwrap.dedent(f"""
        import io, sys, time
        from pathlib import Path
        class Terminal(io.StringIO):
            def isatty(self):
                return True
        out = sys.stderr = Terminal()
        import runner_core.kernels as kernels
        from runner_core.kernels import build as kernel_build
        kernel_build.is_built = lambda: False
        def slow_build():  # a slow build: returns once the bar was redrawn during it
            deadline = time.monotonic() + {WAIT_S}
            while out.getvalue().count("Building the native CPU kernels") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        kernel_build.build = slow_build
        kernels._build()
        sys.__stdout__.write(out.getvalue())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Building the native CPU kernels, every tier (first use; cached afterwards)") >= 3
    assert "1/1" in proc.stdout


def _tiny_program():
    module = torch.nn.Linear(4, 3)
    return torch.export.export(module, (torch.randn(2, 4),))


@pytest.mark.slow  # one cold AOTInductor compile of a tiny module
def test_the_leafspec_future_warning_of_a_cold_aoti_compile_is_not_shown(tmp_path, monkeypatch):
    raised = []  # every warnings.warn call, shown or not (torch's copy of a LeafSpec calls it)
    real_warn = warnings.warn

    def spy(message, category=None, *args, **kwargs):
        raised.append((category, str(message)))
        return real_warn(message, category, *args, **kwargs)

    monkeypatch.setattr(warnings, "warn", spy)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        aoti_program.package(_tiny_program(), str(tmp_path / "tiny.pt2"), None)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)  # outside
    assert (tmp_path / "tiny.pt2").is_file()
    leaf = [m for c, m in raised if c is FutureWarning and "LeafSpec" in m]
    assert len(leaf) >= 2, "torch no longer warns about LeafSpec while packaging: remove aoti_program's filter"
    assert [str(w.message) for w in shown if issubclass(w.category, FutureWarning)] == [
        "`isinstance(treespec, LeafSpec)` is deprecated"], "only the one raised outside packaging is shown"


def test_dashboard_says_its_charts_are_coming_and_how_long_the_session_is_busy(monkeypatch):
    from workbench import Session
    from workbench.views import dashboard, panel_app

    class Busy(Session):  # a session loading a model (as the status line reads it)
        status = "loading tiny-llama…"
        busy = True

    clock = [100.0]
    monkeypatch.setattr(dashboard, "monotonic", lambda: clock[0])
    session = Busy()
    try:
        dash = panel_app.SessionDashboard(session)
        assert all(pane.loading for pane in dash.charts.values()), "until the first live refresh"
        dash.refresh()
        assert not any(pane.loading for pane in dash.charts.values())
        assert dash.status.object == "<b>loading tiny-llama…</b>"
        clock[0] += 12.4
        dash.refresh()
        assert dash.status.object == "<b>loading tiny-llama… (12 s)</b>"
    finally:
        session.close()


def test_the_activation_profile_prints_nothing_to_stderr(capfd):
    """torch's profiler (kineto) writes "USDT ... profiler_start/stop" to file descriptor 2 on every run,
    shown as red lines in a notebook; the memory profile at load silences exactly those."""
    from runner_core.memory.profile import profile_activation_peak

    peak = profile_activation_peak(lambda: torch.randn(256, 256) @ torch.randn(256, 256), torch.device("cpu"))
    err = capfd.readouterr().err
    assert peak > 0 and "profiler_start" not in err and "USDT" not in err
    print("still here", file=sys.stderr)  # file descriptor 2 is back afterwards
    assert "still here" in capfd.readouterr().err
