"""Load held: a soak of the session with random sampling settings, streaming readers on threads, cancels,
bad requests mixed in and a KV pool small enough to force preemption. Every handle ends with the right
finish reason, no block is held after each wave, resident memory stays flat after the first wave, and
seeded requests reproduce across waves (different batches around them).

`make test` runs RUNNER_SOAK_REQUESTS=200; `make soak` 1,200.
"""

from __future__ import annotations

import os
import random
import threading

import pytest

from runner_core import InvalidRequestError, SamplingParams
from runner_core.process_memory import resident_bytes

REQUESTS = int(os.environ.get("RUNNER_SOAK_REQUESTS", "200"))
WAVES = 4
MiB = 2**20
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this".split()
PROBES = [("once upon a time", SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
          ("the river and the hill", SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=11))]


def random_request(rng: random.Random):
    """(kind, prompt, params): kind is normal, stream, cancel or bad."""
    kind = rng.choices(["normal", "stream", "cancel", "bad"], weights=[6, 2, 1, 1])[0]
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
    params = SamplingParams(max_tokens=rng.randint(1, 48), temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
                            top_p=rng.choice([1.0, 0.9, 0.5]), top_k=rng.choice([0, 1, 20]),
                            min_p=rng.choice([0.0, 0.05]), seed=rng.choice([None, rng.randrange(2**32)]),
                            ignore_eos=rng.random() < 0.5)
    if kind == "bad":
        prompt = rng.choice(["", [5, 10**6], {"prompt": "x", "bogus": 1}, "y " * 400])
    return kind, prompt, params


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    from workbench import Session

    s = Session()
    entry = s.load_model(str(tiny_llama_path), dtype="float32", max_model_len=256, max_num_seqs=16)
    per_token = s.memory_stats()["kv_bytes_per_token"]
    s.unload(entry.name)
    # 24 blocks of 16 tokens: a few long requests fill it, so the scheduler must preempt
    s.load_model(str(tiny_llama_path), dtype="float32", max_model_len=256, max_num_seqs=16,
                 kv_cache_memory=24 * 16 * per_token)
    yield s
    s.close()


def run_wave(session, rng: random.Random, n: int) -> list[list[int]]:
    handles, readers, streamed = [], [], {}
    for i in range(n):
        kind, prompt, params = random_request(rng)
        h = session.submit(prompt, sampling_params=params)
        handles.append((kind, params, h))
        if kind == "stream":
            def read(h=h):
                streamed[h.request_id] = "".join(h.stream())  # a hang is pytest-timeout's
            readers.append(threading.Thread(target=read))
            readers[-1].start()
        elif kind == "cancel":
            threading.Timer(rng.random() * 0.05, h.cancel).start()
        if i == n // 2:
            probes = [session.submit(p, sampling_params=sp) for p, sp in PROBES]
    for kind, params, h in handles:
        if kind == "bad":
            with pytest.raises(InvalidRequestError):
                h.result(timeout=120)
            assert h.finish_reason == "error" and h.error
            continue
        out = h.result(timeout=120)
        if kind == "cancel":
            assert out.finish_reason in ("abort", "stop", "length")
        else:
            assert out.finish_reason in ("stop", "length"), (out.finish_reason, out.error)
            assert len(out.token_ids) == params.max_tokens or (out.finish_reason == "stop" and not params.ignore_eos)
    for t in readers:
        t.join(timeout=120)
    for kind, _, h in handles:
        if kind == "stream":
            assert streamed[h.request_id] == h.result().text
    assert session.wait_idle(timeout=120)
    assert session.memory_stats()["blocks_used"] == 0
    return [p.result(timeout=120).token_ids for p in probes]


@pytest.mark.timeout(max(600, 2 * REQUESTS))  # seconds: a busy 2-core machine serves ~1-4 requests/s here
def test_soak(session):
    import time

    start = time.perf_counter()
    rng = random.Random(1234)
    per_wave = REQUESTS // WAVES
    probe_tokens = [run_wave(session, rng, per_wave)]
    first = resident_bytes()
    for _ in range(WAVES - 1):
        probe_tokens.append(run_wave(session, rng, per_wave))
    growth = resident_bytes() - first
    preempted = sum(r.get("preempted", 0) for r in session.metrics.rows())
    print(f"soak: {per_wave * WAVES + len(PROBES) * WAVES} requests in {WAVES} waves, {preempted} preemptions, "
          f"resident after wave 1 {first / MiB:.0f} MiB, growth after it {growth / MiB:+.1f} MiB, "
          f"{time.perf_counter() - start:.0f} s")
    assert all(t == probe_tokens[0] for t in probe_tokens)  # seeded requests reproduce in any batch
    assert preempted > 0  # the pool was small enough to force preemption
    assert growth < 24 * MiB
