"""Unload means unloaded: after `session.unload()` / `runner.shutdown()` the process's resident memory
returns to within a few MiB of before the load, and load -> unload x20 does not grow."""

from __future__ import annotations

import pytest

from runner_core import ModelRunner, SamplingParams
from runner_core.memory import resident_bytes

MiB = 2**20
POOL = 512 * MiB
SHORT = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def session():
    from workbench import Session

    s = Session()
    yield s
    s.close()


def _load(session, path, pool=POOL):
    session.load_model(str(path), dtype="float32", kv_cache_memory=pool)
    session.generate("warm the pool up", sampling_params=SHORT)


def test_session_unload_returns_the_memory(session, tiny_llama_path):
    from runner_core.models.presets import ensure_preset

    _load(session, tiny_llama_path, 64 * MiB)  # first-use costs (imports, kernels, caches) are paid here
    session.unload()
    before = resident_bytes()
    # small-llama's 120 MiB of weights are many mid-sized tensors: the C heap keeps their pages unless
    # it is trimmed (without release_freed_memory this test measures ~40 MiB left behind, with it ~7)
    _load(session, ensure_preset("small-llama"), 64 * MiB)
    loaded = resident_bytes()
    weights = session.memory_stats()["weights_bytes"]
    session.unload()
    after = resident_bytes()
    print(f"resident: before {before / MiB:.1f} MiB, loaded +{(loaded - before) / MiB:.1f}, "
          f"after unload {(after - before) / MiB:+.1f} MiB")
    assert loaded - before > weights  # the weights and the pool were resident
    assert after - before < 16 * MiB


def test_runner_shutdown_returns_the_memory(tiny_llama_path):
    def cycle():
        r = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": POOL}).load_model()
        r.generate("hello", SHORT)
        r.shutdown()

    cycle()
    before = resident_bytes()
    cycle()
    assert resident_bytes() - before < 8 * MiB


def test_load_unload_twenty_times_does_not_grow(session, tiny_llama_path):
    figures = []
    for _ in range(20):
        _load(session, tiny_llama_path, 32 * MiB)
        session.unload()
        figures.append(resident_bytes())
    print("resident after each unload (MiB):", [round(f / MiB) for f in figures])
    assert max(figures[5:]) - figures[4] < 8 * MiB
