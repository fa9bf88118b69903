"""Decode programs: static-size programs for pure-decode steps (CPU: AOTInductor packages on
MKL-prepacked weights), the padding that routes a decode batch to the next size, and the
static-length decode metadata CUDA graphs replay over (checked here on the CPU, uncompiled).

The compiled runner uses test_compile's configuration (compile sizes 1 and 4) and the run's
shared compile cache, so its packages are built once per run."""

from __future__ import annotations

import pytest
import torch

from runner_core import ConfigError, ModelRunner, SamplingParams
from runner_core.compile import DecodePrograms, plan_sizes
from runner_core.compile import decode_plan as dp
from runner_core.engine import StepBatch
from runner_core.layers.attention import Attention, set_forward_context
from tests.conftest import COMPILE_CACHE_DIR, COMPILED
from tests.test_compile import GREEDY, _prompts

LOGPROBS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _row_major(config: dict) -> ModelRunner:
    """A runner whose linear weights stay row-major: the layout CPU decode programs pack MKL's copy of, which
    a runner keeps where the native kernels are off (with them on, the weights are stored once, as panels)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("runner_core.loader.model_loader.panels_apply", lambda *args: False)
        mp.setattr("runner_core.memory.estimate.panels_apply", lambda *args: False)  # predicted likewise
        return ModelRunner(config).load_model()


@pytest.fixture(scope="module")
def compiled(tiny_llama_path):
    # a short max_model_len leaves room to shrink the pool (the compile key does not depend on it)
    return _row_major({"model": str(tiny_llama_path), **COMPILED})


@pytest.fixture(scope="module")
def eager(tiny_llama_path):
    # the compiled runner's max_model_len (its rotary table's length is part of the compile key): switched
    # to compiled, this runner hits the packages the compiled fixture wrote
    return _row_major({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22,
                       "max_model_len": COMPILED["max_model_len"]})


def _run(runner, prompts, params=LOGPROBS):
    outs = runner.generate(prompts, params)
    return [o.token_ids for o in outs], [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]


def _assert_same(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=1e-4)


def test_padded_decode_batches_equal_eager(compiled, eager):
    """Three sequences decode at size 4 (one pad row repeating the first), one at size 1:
    tokens equal eager's and log-probabilities close; five sequences use the general program."""
    programs = compiled.engine.worker.forward_pass.decode_programs
    assert programs.sizes == [1, 4] and compiled.compile_stats()["decode_programs"]["cache"]
    before = dict(programs.runs), programs.padded_rows
    for prompts in (_prompts()[:3], _prompts()[3:4], _prompts()):
        _assert_same(_run(compiled, prompts), _run(eager, prompts))
    assert programs.runs[4] - before[0][4] >= 11 and programs.runs[1] - before[0][1] >= 11
    assert programs.padded_rows - before[1] >= 11
    assert compiled.compile_stats()["recompiles_after_warmup"] == 0


def test_decode_program_reads_a_rebound_pool(compiled, eager):
    """The pool is a program input, not a constant: after defragment + shrink re-binds it,
    decoding through the programs still matches eager."""
    old_pool = compiled.engine.memory.kv_cache
    compiled.defragment(shrink_to_blocks=compiled.engine.memory.num_blocks - 8)
    assert compiled.engine.memory.kv_cache.data_ptr() != old_pool.data_ptr()
    _assert_same(_run(compiled, _prompts()[:3]), _run(eager, _prompts()[:3]))
    assert compiled.compile_stats()["decode_programs"]["misses"] == 0
    assert compiled.compile_stats()["decode_programs"]["rebuilds"] == 0  # the pool is an input: nothing to rebuild


def test_prepacked_weights_are_reported_and_dropped(compiled):
    stats = compiled.memory_stats()
    packed = [n for n, _ in compiled.model.named_buffers() if n.endswith(".storage.packed")]
    assert stats["decode_programs_bytes"] == compiled.compile_stats()["decode_programs"]["memory_bytes"] > 0
    estimate = compiled.memory_estimate  # predicted before loading, from config.json alone
    assert estimate.decode_programs_bytes == stats["decode_programs_bytes"]
    assert "decode programs" in str(estimate) and estimate.fixed_bytes >= estimate.weights_bytes + stats[
        "decode_programs_bytes"]
    assert len(packed) == 4 * compiled.engine.hf_config.num_hidden_layers
    compiled.set_compile_mode(False)
    try:
        assert compiled.memory_stats()["decode_programs_bytes"] == 0
        assert not any(n.endswith(".storage.packed") for n, _ in compiled.model.named_buffers())
    finally:
        stats = compiled.set_compile_mode(True)
    assert stats["cache"] == "hit" and set(stats["decode_programs"]["cache"].values()) == {"hit"}


class _EagerAtSizes(DecodePrograms):
    """The model as is, at fixed sizes: exercises padding and static metadata without compiling."""

    kind = "eager (test)"

    def _run(self, n, input_ids, positions, meta):
        return self.model(input_ids, positions)


def test_static_length_decode_metadata_matches(eager):
    """The CUDA-graph data path on the CPU: decodes padded to size 4 with the gather-based
    attention over a fixed key length (every block-table column, masked past each context)."""
    reference = _run(eager, _prompts()[:3])
    fp = eager.engine.worker.forward_pass
    programs = _EagerAtSizes(eager.model, [4])
    programs.static_decode_len = fp.buffers.max_blocks * fp.block_size
    fp.decode_programs, kernel = programs, fp.decode_kernel
    fp.decode_kernel = False
    engine = eager.engine
    try:
        seqs = [engine.add_request(p, GREEDY) for p in _prompts()[:3]]
        engine.step()  # their prefills, on the general path
        inp = fp.prepare(StepBatch.build([(s, 1) for s in seqs])[0])
        assert inp.num_pad_tokens == 1 and tuple(inp.meta.decode_kv_idx.shape) == (4, programs.static_decode_len)
        for s in seqs:
            engine.abort_request(s.request_id)
        _assert_same(_run(eager, _prompts()[:3]), reference)
        assert programs.runs[4] >= 11 and programs.padded_rows >= 11
    finally:
        fp.decode_programs, fp.decode_kernel = None, kernel


class _AddressBound(_EagerAtSizes):
    """A CUDA graph's contract on the CPU: each size is built over the pool tensors the model is
    bound to at that moment (their addresses) and always runs on those; its warm-up writes dummy
    K/V into block 0 over the static key length, as a capture does."""

    kind = "address-bound (test)"
    holds_pool_address = True

    def __init__(self, model, sizes, static_decode_len):
        super().__init__(model, sizes)
        self.static_decode_len, self.layers, self.pools = static_decode_len, [
            m for m in model.modules() if isinstance(m, Attention)], {}

    def _build_size(self, size, run_dummy):
        ids, positions, meta = run_dummy(size, self.static_decode_len)
        with torch.inference_mode(), set_forward_context(meta, True):
            self.model(ids, positions)
        self.pools[size] = [layer.kv_cache for layer in self.layers]

    def _drop(self):
        self.pools.clear()

    def _run(self, n, input_ids, positions, meta):
        bound = [layer.kv_cache for layer in self.layers]
        for layer, pool in zip(self.layers, self.pools[n]):
            layer.kv_cache = pool
        try:
            return self.model(input_ids, positions)
        finally:
            for layer, pool in zip(self.layers, bound):
                layer.kv_cache = pool


def _finish(runner, ids) -> dict:
    done = {}
    while runner.has_unfinished_requests():
        done.update({o.request_id: o for o in runner.step() if o.finished})
    return {i: done[i].token_ids for i in ids}


def test_programs_holding_the_pool_address_are_rebuilt_when_it_moves(tiny_llama_path, eager):
    """A shrink re-allocates the pool mid-generation: programs built over the old tensor's address
    (CUDA graphs) are rebuilt over the new one, and block 0, which their warm-up writes and which
    holds a live sequence's keys by then, keeps its contents. Running sequences, and requests that
    arrive after the shrink, decode through the programs to eager's tokens."""
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22,
                          "max_model_len": 256, "attention_backend": "gather"}).load_model()
    fp, memory = runner.engine.worker.forward_pass, runner.engine.memory
    programs = _AddressBound(runner.model, [1, 4], fp.buffers.max_blocks * fp.block_size)
    fp.decode_programs = programs.build(fp.dummy_decode)
    first, later = _prompts()[:4], _prompts()[1:4]
    expected = [o.token_ids for o in eager.generate(first + later, GREEDY)]
    ids = [runner.add_request(p, GREEDY) for p in first]
    for _ in range(4):
        runner.step()
    assert 0 in runner.engine.requests[ids[0]].block_table  # a live sequence owns block 0
    old_pool = memory.kv_cache
    runner.defragment(shrink_to_blocks=memory.num_blocks // 2)
    assert memory.kv_cache is not old_pool and programs.rebuilds == 1
    assert [pool.data_ptr() for pool in programs.pools[4]] == [layer.data_ptr() for layer in memory.kv_cache]
    runs = dict(programs.runs)
    got = list(_finish(runner, ids).values())
    got += list(_finish(runner, [runner.add_request(p, GREEDY) for p in later]).values())
    assert got == expected
    assert programs.runs[4] > runs[4]
    runner.defragment()  # the pool stays where it is: nothing to rebuild
    assert programs.rebuilds == 1


def test_plan_says_why_there_are_none(eager, monkeypatch):
    model = eager.model
    assert plan_sizes(None, model, torch.float32, 8, "aoti") == ([1], "device default")
    assert plan_sizes([2, 16], model, torch.float32, 8, "aoti") == ([2], "configured")
    assert plan_sizes(None, model, torch.float32, 8, "jit")[1].startswith("the 'jit' route")
    assert "float32" in plan_sizes(None, model, torch.bfloat16, 8, "aoti")[1]
    monkeypatch.setattr(dp, "available_memory_bytes", lambda device: 1 << 20)
    sizes, why = plan_sizes(None, model, torch.float32, 8, "aoti")
    assert sizes == [] and "over half the available memory" in why


def test_programs_over_weights_stored_once_take_no_copy(compiled_tiny_llama, eager):
    """With the kernels on, each linear weight is held once, as panels: the programs multiply those (no MKL
    copy is made) and give eager's tokens."""
    runner = compiled_tiny_llama
    programs = runner.engine.worker.forward_pass.decode_programs
    assert programs.sizes == [1, 4] and programs.kind.endswith("stored weights")
    assert runner.memory_stats()["decode_programs_bytes"] == 0
    assert not any(n.endswith(".storage.packed") for n, _ in runner.engine.worker.model.named_buffers())
    runs = programs.runs[4]
    assert _run(runner, _prompts()[:3])[0] == _run(eager, _prompts()[:3])[0] and programs.runs[4] >= runs + 11


def test_bad_compile_sizes_are_refused(tiny_llama_path):
    with pytest.raises(ConfigError, match="compile_sizes.*ints >= 1"):
        ModelRunner({"model": str(tiny_llama_path), "compile_sizes": [0, 4]})
    with pytest.raises(ConfigError, match="compile_sizes"):
        ModelRunner({"model": str(tiny_llama_path), "compile_sizes": "1,2"})


def test_cuda_capture_plan_bounds_graph_memory(eager):
    """What the KV-pool plan leaves free on CUDA for the decode graphs (the static-length decode of
    the largest capture size), and the sizes left out when that would exceed 10% of the device;
    nothing when inductor captures its own graphs or none are made. Pure arithmetic: runs on CPU."""
    from types import SimpleNamespace

    hf, big = eager.engine.hf_config, 1 << 50
    cfg = SimpleNamespace(compile=True, enforce_eager=False, torch_device=torch.device("cuda"), world_size=1,
                          compile_backend="inductor", compile_mode="default", compile_scope="model",
                          compile_sizes=None, max_num_seqs=64, torch_dtype=torch.float16, attention_backend="gather",
                          block_size=16)
    with_sizes = lambda sizes: SimpleNamespace(**{**vars(cfg), "compile_sizes": sizes})  # noqa: E731
    sizes, reserve, why = dp.cuda_capture_plan(cfg, hf, 2048, big)
    assert (sizes, why) == ([1, 2, 4, 8, 16, 32, 48, 64], "device default")
    peak8 = dp.cuda_capture_plan(with_sizes([1, 8]), hf, 2048, big)[1]
    assert reserve > peak8 > 0 and reserve > dp.cuda_capture_plan(cfg, hf, 256, big)[1]  # keys: max_model_len
    sizes, reserve, why = dp.cuda_capture_plan(cfg, hf, 2048, 10 * peak8 + 10)  # room for size 8 at most
    assert sizes == [1, 2, 4, 8] and reserve == peak8
    assert "sizes [16, 32, 48, 64] left out" in why and "over 10% of the device" in why
    # flex (CUDA's "auto") reads the pool in place: the graphs' memory does not grow with max_model_len
    flex = SimpleNamespace(**{**vars(cfg), "attention_backend": "auto"})
    flex_reserve = dp.cuda_capture_plan(flex, hf, 2048, big)[1]
    assert flex_reserve == dp.cuda_capture_plan(flex, hf, 256, big)[1] and flex_reserve < peak8
    # the default mode ("auto") on CUDA leaves the decode steps to these graphs (inductor captures none)
    auto = SimpleNamespace(**{**vars(cfg), "compile_mode": "auto"})
    assert dp.cuda_capture_plan(auto, hf, 2048, big)[0] == [1, 2, 4, 8, 16, 32, 48, 64]
    for change in ({"compile_mode": "reduce-overhead"}, {"compile_sizes": []}, {"compile": False},
                   {"torch_device": torch.device("cpu")}, {"world_size": 2}):
        assert dp.cuda_capture_plan(SimpleNamespace(**{**vars(cfg), **change}), hf, 2048, big)[:2] == ([], 0), change


def test_default_keeps_the_decode_program_only_when_it_pays(eager, monkeypatch):
    """With compile_sizes unset the batch-1 program is timed against the general one at load and
    kept only when it is at least 10% faster; dropped, its packed weights are released."""
    eng = eager.engine
    saved = eng.worker.config
    eng.worker.config = saved.replace(compile_cache_dir=str(COMPILE_CACHE_DIR))  # the compiled fixture's packages: hits
    switch = lambda: eager.set_compile_mode(True, backend="inductor", mode="default", scope="layer")  # noqa: E731
    try:
        measured = switch()["decode_programs"]["reason"]  # whichever way this machine measures it
        assert "ms per 1-token step vs" in measured and "for the general program" in measured
        monkeypatch.setattr(dp.PackedDecodePrograms, "pays_off", lambda self, run, rounds=5: (False, "slower"))
        stats = switch()
        assert stats["decode_programs"] == {"sizes": [], "reason": "device default [1] dropped: slower"}
        assert eng.worker.forward_pass.decode_programs is None and eager.memory_stats()["decode_programs_bytes"] == 0
        assert not any(n.endswith(".storage.packed") for n, _ in eng.worker.model.named_buffers())
        monkeypatch.setattr(dp.PackedDecodePrograms, "pays_off", lambda self, run, rounds=5: (True, "faster"))
        stats = switch()
        assert stats["decode_programs"]["sizes"] == [1] and stats["decode_programs"]["reason"].endswith("; faster")
        assert eager.memory_stats()["decode_programs_bytes"] > 0
        assert [o.token_ids for o in eager.generate(_prompts()[3:4], GREEDY)][0]
    finally:
        eager.set_compile_mode(False)
        eng.worker.config = saved


def test_cuda_graphs_are_captured_on_the_runners_device(eager, monkeypatch):
    """The capture's streams, graph pool, memory figures and syncs follow the current CUDA device, which was not
    the runner's when it runs on another GPU (cuda:1): every CUDA call of a capture and a drop now happens with the
    runner's device current (issue 39). The CUDA runtime is recorded, not run: the model runs on the CPU."""
    from contextlib import contextmanager, nullcontext
    from types import SimpleNamespace

    from runner_core.compile.decode_programs import CUDAGraphDecodePrograms

    current, calls = ["cuda:0"], []

    @contextmanager
    def device(d):
        saved, current[0] = current[0], str(d)
        try:
            yield
        finally:
            current[0] = saved

    def recorded(name, result=None):
        return lambda *a, **k: calls.append((name, current[0])) or result

    stream = SimpleNamespace(wait_stream=recorded("wait_stream"))
    for name, fake in {"device": device, "graph_pool_handle": recorded("graph_pool_handle", object()),
                       "memory_reserved": recorded("memory_reserved", 0), "Stream": recorded("Stream", stream),
                       "current_stream": recorded("current_stream", stream), "stream": lambda s: nullcontext(),
                       "CUDAGraph": recorded("CUDAGraph", object()), "graph": lambda g, pool: nullcontext(),
                       "synchronize": recorded("synchronize"), "empty_cache": recorded("empty_cache")}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    worker = eager.engine.worker
    runner_device = torch.device("cuda", 1)
    with worker.memory.block_kept(0):
        programs = CUDAGraphDecodePrograms(eager.model, [1, 2], worker.forward_pass.buffers.max_blocks * 16,
                                           runner_device)
        programs.build(worker.forward_pass.dummy_decode)
        programs.rebuild(worker.forward_pass.dummy_decode)
    assert sorted(programs.graphs) == [1, 2] and current == ["cuda:0"]
    assert {name for name, _ in calls} >= {"graph_pool_handle", "Stream", "CUDAGraph", "synchronize", "empty_cache"}
    assert {where for _, where in calls} == {"cuda:1"}
