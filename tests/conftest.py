"""Session-wide test settings: a preset cache inside the repo, few CPU threads, the tiny preset, the
`tier` fixture that runs a kernel test on every kernel tier this CPU runs, and the longest test files first
(with `make test`'s worker processes, a long file started last would finish alone)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# OpenMP threads sleep at barriers, as runner_core sets it when it loads first (runner_core/openmp_env.py);
# here torch loads first, so the suite sets it itself: a spinning wait makes 2 threads on a busy machine slow
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Set before any test builds a preset; subprocesses (workers, notebooks) inherit it.
os.environ["RUNNER_WORKBENCH_CACHE"] = str(REPO / "test-output" / "cache")
# dtype="auto" is float32 on every CPU in the tests (bfloat16 where the CPU has native bf16 matmuls
# otherwise), so the tests run alike on every machine; tests of the choice itself unset it.
os.environ["RUNNER_CORE_CPU_BF16"] = "0"
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    from runner_core.models.presets import ensure_preset

    return ensure_preset("tiny-llama")


COMPILE_CACHE_DIR = REPO / "test-output" / "compile-cache"
# tiny-llama compiled (inductor, per layer) with CPU decode programs of sizes 1 and 4, its cache shared by a run
COMPILED = {"dtype": "float32", "kv_cache_memory": 1 << 22, "compile": True, "compile_backend": "inductor",
            "compile_mode": "default", "compile_scope": "layer", "compile_cache_dir": str(COMPILE_CACHE_DIR),
            "compile_sizes": [1, 4], "max_model_len": 256}


@pytest.fixture(scope="module")
def api_session(tiny_llama_path):
    """A Session with tiny-llama loaded, for one module's API tests (closed after)."""
    from tests.sessions import tiny_session

    yield from tiny_session()


@pytest.fixture(scope="module")
def api_client(api_session):
    """The official openai client on api_session's API server."""
    from tests.sessions import openai_client

    yield from openai_client(api_session)


@pytest.fixture(scope="session")
def compiled_tiny_llama(tiny_llama_path):
    """One compiled tiny-llama runner for every module that only reads it or generates with it (a compile
    takes tens of seconds on these CPUs). A test that switches its compile mode switches it back."""
    from runner_core import ModelRunner

    runner = ModelRunner({"model": str(tiny_llama_path), **COMPILED}).load_model()
    yield runner
    runner.shutdown()


# the files that take the longest (pytest --durations), started first
LONGEST_FIRST = ("tests/test_jupyterlab.py", "tests/test_commands_run.py", "tests/test_parallel.py",
                 "tests/test_compile.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_generate_tests(metafunc):
    """A test taking the `tier` fixture runs once per kernel tier this CPU runs, its id naming the tier
    (a test parametrizing its own `tier` argument keeps its values)."""
    own = {name.strip() for mark in metafunc.definition.iter_markers("parametrize")
           for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])}
    if "tier" in metafunc.fixturenames and "tier" not in own:
        from runner_core.kernels import kernel_tiers

        metafunc.parametrize("tier", kernel_tiers() or ["kernels-off"], indirect=True)


@pytest.fixture
def tier(request):
    """The native kernels of one tier (`use_kernel_tier`) for the test. The kernels not loading, or no
    plain tier among the runnable ones, fails the test: gcc and ninja are project requirements and the
    plain tier runs on every CPU."""
    from runner_core.kernels import cpu_kernels_available, kernel_tiers, use_kernel_tier

    assert cpu_kernels_available(), "the native CPU kernels did not load; see the warning logged above"
    assert "plain" in kernel_tiers(), f"the plain kernel tier runs on every CPU, but this one runs {kernel_tiers()}"
    with use_kernel_tier(request.param):
        yield request.param
