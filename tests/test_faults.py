"""Faults injected into a running engine (runner_core/faults.py points, real files, real interrupts):
the failing requests end with a clear error, every other request and the engine go on, no KV block leaks."""

from __future__ import annotations

import _thread
import errno
import gc
import logging
import shutil
import signal
import threading
import warnings

import pytest
import torch

from runner_core import ModelLoadError, ModelRunner, SamplingParams, faults
from tests.sessions import slow_steps

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["one two three", "four five", "six seven eight nine", "ten"]


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "max_model_len": 64, "max_num_seqs": 2,
                        "kv_cache_memory": 1 << 22}).load_model()


@pytest.fixture(scope="module")
def clean(runner):
    return [o.token_ids for o in runner.generate(PROMPTS, GREEDY)]


def on_call(n: int, action):
    """A hook that runs `action(value)` on its n-th call (1-based) and passes every other value through."""
    calls = {"n": 0}

    def hook(value):
        calls["n"] += 1
        return action(value) if calls["n"] == n else value
    return hook


def raise_(exc):
    def action(_value):
        raise exc
    return action


def assert_no_blocks_held(runner):
    stats = runner.memory_stats()
    assert stats["blocks_used"] == 0, stats


def test_unknown_fault_point_is_refused():
    with pytest.raises(ValueError, match="unknown fault point 'forwrd'; the points are forward"):
        with faults.inject("forwrd", lambda v: v):
            pass


def test_exception_in_one_step_fails_that_steps_requests_only(runner, clean):
    # max_num_seqs=2: the first two requests run together, the last two wait; step 2 (a decode of the
    # first two) raises
    with faults.inject("forward", on_call(2, raise_(RuntimeError("injected forward failure")))):
        outs = runner.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error", "length", "length"]
    assert all("RuntimeError: injected forward failure" in o.error for o in outs[:2])
    assert [o.token_ids for o in outs[2:]] == clean[2:]
    assert_no_blocks_held(runner)
    assert [o.token_ids for o in runner.generate(PROMPTS, GREEDY)] == clean  # the next steps run as before


def test_nonfinite_logits_fail_one_request_and_the_batch_goes_on(runner, clean):
    def poison_row0(logits):
        logits = logits.clone()
        logits[0, 3] = float("nan")
        return logits

    with faults.inject("logits", on_call(3, poison_row0)):
        outs = runner.generate(PROMPTS, GREEDY)
    failed = [i for i, o in enumerate(outs) if o.finish_reason == "error"]
    assert len(failed) == 1 and "NaN or infinite logits" in outs[failed[0]].error
    assert all(outs[i].token_ids == clean[i] for i in range(len(PROMPTS)) if i not in failed)
    assert_no_blocks_held(runner)


def test_minus_inf_alone_is_a_masked_token_not_a_fault(runner, clean):
    def mask_token(logits):
        logits = logits.clone()
        logits[:, 0] = float("-inf")  # token 0 is never the greedy choice here
        return logits

    with faults.inject("logits", mask_token):
        outs = runner.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == clean


def test_interrupt_during_generate_aborts_that_call_and_the_runner_stays_usable(runner, clean):
    with faults.inject("forward", on_call(3, raise_(KeyboardInterrupt()))), pytest.raises(KeyboardInterrupt):
        runner.generate(PROMPTS, GREEDY)
    assert not runner._engine().has_unfinished_requests()
    assert_no_blocks_held(runner)
    assert [o.token_ids for o in runner.generate(PROMPTS, GREEDY)] == clean


def test_interrupt_during_session_generate_aborts_the_request(tiny_llama_path):
    from workbench import Session

    # Python's own SIGINT handler, as a Jupyter kernel has one: in the fresh-clone run something earlier in the
    # process left another one (interrupt_main then raises nothing), which a run of the files before never showed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    session = Session()
    try:
        session.load_model(str(tiny_llama_path), dtype="float32", max_model_len=512)
        expected = session.generate("a b c", sampling_params=GREEDY).token_ids
        # Jupyter's stop button raises KeyboardInterrupt in the kernel's main thread while it waits
        timer = threading.Timer(0.5, _thread.interrupt_main)
        handles, submit = [], session.submit
        session.submit = lambda *a, **kw: handles.append(submit(*a, **kw)) or handles[-1]
        # steps of at least 10 ms: the request is still running when the interrupt comes (tiny-llama alone on
        # a quiet machine makes 480 tokens in under 0.5 s)
        with slow_steps(session, str(tiny_llama_path), delay=0.01), pytest.raises(KeyboardInterrupt):
            timer.start()
            session.generate("a b c", sampling_params=SamplingParams(max_tokens=480, ignore_eos=True))
        timer.cancel()
        # the interrupt acted while the request ran (a waiter blocked in one long lock wait saw it only at the end)
        assert handles[0].result(timeout=60).finish_reason == "abort" and handles[0].num_tokens < 480
        assert session.wait_idle(timeout=60) and not session.inflight()
        assert session.memory_stats()["blocks_used"] == 0
        assert session.generate("a b c", sampling_params=GREEDY).token_ids == expected
    finally:
        session.close()
        signal.signal(signal.SIGINT, previous)


def test_compile_failure_in_a_session_switch_keeps_eager_serving(tiny_llama_path):
    from workbench import Session

    session = Session()
    try:
        session.load_model(str(tiny_llama_path), dtype="float32")
        expected = session.generate("a b c", sampling_params=GREEDY).token_ids
        with faults.inject("compile", raise_(RuntimeError("injected compiler crash"))):
            stats = session.set_compile_mode(True, backend="eager")
        assert not stats["enabled"] and "injected compiler crash" in stats["reason"]
        assert session.generate("a b c", sampling_params=GREEDY).token_ids == expected
    finally:
        session.close()


def _compiled_runner(path, cache_dir):
    return ModelRunner({"model": str(path), "dtype": "float32", "compile": True, "compile_backend": "eager",
                        "compile_cache_dir": str(cache_dir)}).load_model()


def test_unwritable_compile_cache_warns_and_compiles_uncached(tiny_llama_path, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder below a file cannot be made, even by root
    with caplog.at_level(logging.WARNING, logger="runner_core"):
        r = _compiled_runner(tiny_llama_path, blocker / "cache")
    try:
        stats = r.compile_stats()
        assert stats["enabled"] and stats["cache"] == "uncached" and "NotADirectoryError" in stats["uncached_reason"]
        assert "is not writable" in caplog.text and "compiling without the persistent cache" in caplog.text
        eager = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32"}).load_model()
        assert r.generate(PROMPTS, GREEDY)[0].token_ids == eager.generate(PROMPTS, GREEDY)[0].token_ids
    finally:
        r.shutdown()


def test_full_disk_compile_cache_warns_and_compiles_uncached(tiny_llama_path, tmp_path, caplog):
    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with faults.inject("cache_write", full), caplog.at_level(logging.WARNING, logger="runner_core"):
        r = _compiled_runner(tiny_llama_path, tmp_path / "cache")
    try:
        assert r.compile_stats()["cache"] == "uncached" and "No space left" in caplog.text
        assert r.generate("a b c", GREEDY)[0].finish_reason == "length"
        assert not list((tmp_path / "cache").rglob("*.bin"))  # no partial file left behind
    finally:
        r.shutdown()


def _large_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() >= 4096)


@pytest.mark.parametrize("damage, names", [
    ("weights", ["model.safetensors", "corrupt or truncated"]),
    ("config", ["config.json", "is not valid JSON", "save_pretrained"]),
    ("tokenizer", ["cannot load the tokenizer", "tokenizer.json"]),
])
def test_damaged_checkpoint_is_refused_and_nothing_stays_loaded(tiny_llama_path, tmp_path, damage, names):
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_path, path)
    if damage == "weights":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif damage == "config":
        (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    else:
        (path / "tokenizer.json").write_text('{"version": "1.0", "model": 17}')
    before = _large_tensors()
    runner = ModelRunner({"model": str(path), "dtype": "float32"})
    with pytest.raises(ModelLoadError) as e:
        runner.load_model()
    message = str(e.value)
    assert all(n in message for n in names), message
    assert str(path) in message
    assert _large_tensors() <= before  # nothing half-loaded is held, even by the traceback we still hold
