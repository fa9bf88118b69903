"""torch.compile: parity with eager, no recompiles under continuous batching, the persistent
cache (hit in a second process, key factors, corrupt entries), refusals and the eager fallback.

One cold compile per test run: every compiled runner here uses the same configuration and
the run's shared cache directory."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from runner_core import CompileError, ConfigError, EngineBusyError, ModelRunner, SamplingParams
from runner_core.compile import aoti_program, compile_cache
from runner_core.compile import compile_optimizer as co
from runner_core.config import CUDA_GRAPH_MODES
from tests.conftest import COMPILE_CACHE_DIR as CACHE_DIR
from tests.conftest import COMPILED, REPO

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 7, 33, 64, 2)]


@pytest.fixture(scope="module")
def compiled(compiled_tiny_llama):
    return compiled_tiny_llama


@pytest.fixture(scope="module")
def eager(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()


def test_compiled_greedy_equals_eager(compiled, eager):
    stats = compiled.compile_stats()
    assert stats["enabled"] and stats["backend"] == "inductor" and stats["scope"] == "layer"
    assert stats["graph_breaks"] == 0
    assert [o.token_ids for o in compiled.generate(_prompts(), GREEDY)] == \
        [o.token_ids for o in eager.generate(_prompts(), GREEDY)]
    ids = torch.tensor([_prompts()[3][:20]])
    torch.testing.assert_close(compiled.forward(ids)["logits"], eager.forward(ids)["logits"], atol=1e-4, rtol=1e-4)


def test_no_recompiles_under_continuous_batching(compiled):
    before = compiled.compile_stats()["recompiles_after_warmup"]
    prompts = _prompts()
    compiled.add_request(prompts[3], GREEDY)
    for _ in range(3):
        compiled.step()
    for p in prompts:  # joins mid-flight: steps mix decodes with prefills of many sizes
        compiled.add_request(p, SamplingParams(max_tokens=9, temperature=0.8, seed=1))
    while compiled.has_unfinished_requests():
        compiled.step()
    assert compiled.compile_stats()["recompiles_after_warmup"] == before == 0


def test_second_process_hits_the_cache(compiled, tiny_llama_path):
    assert compiled.compile_stats()["cache"] in ("miss", "hit", "rebuilt")
    script = textwrap.dedent(f"""
        import json
        from runner_core import ModelRunner
        r = ModelRunner({{"model": {str(tiny_llama_path)!r}, **{COMPILED!r}}}).load_model()
        s = r.compile_stats()
        print(json.dumps({{"cache": s["cache"], "key": s["cache_key"]}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"cache": "hit", "key": compiled.compile_stats()["cache_key"]}


def test_switching_mode_on_a_loaded_runner(compiled, eager):
    compiled.set_compile_mode(False)
    assert not compiled.compile_stats()["enabled"]
    assert [o.token_ids for o in compiled.generate(_prompts()[:2], GREEDY)] == \
        [o.token_ids for o in eager.generate(_prompts()[:2], GREEDY)]
    stats = compiled.set_compile_mode(True, backend="inductor", mode="default", scope="layer")
    assert stats["enabled"] and stats["cache"] == "hit"


def test_mode_switch_refused_while_busy(compiled):
    rid = compiled.add_request("busy", GREEDY)
    with pytest.raises(EngineBusyError, match="while requests are running"):
        compiled.set_compile_mode(False)
    compiled.abort_request(rid)


def test_bad_backend_and_mode_are_refused(eager):
    with pytest.raises(ConfigError, match="compile_backend.*'nope'.*inductor"):
        eager.set_compile_mode(True, backend="nope")
    with pytest.raises(ConfigError, match="compile_mode.*'fast'.*max-autotune"):
        eager.set_compile_mode(True, mode="fast")


def test_key_changes_with_dtype_mode_and_sources(eager):
    hf = eager.engine.hf_config
    base = co.CompileSettings(True, "inductor", "default", "model")
    cpu = torch.device("cpu")
    k = compile_cache.cache_key(compile_cache.cache_key_factors(hf, torch.float32, cpu, base))
    assert k == compile_cache.cache_key(compile_cache.cache_key_factors(hf, torch.float32, cpu, base))
    assert k != compile_cache.cache_key(compile_cache.cache_key_factors(hf, torch.bfloat16, cpu, base))
    assert k != compile_cache.cache_key(compile_cache.cache_key_factors(hf, torch.float32, cpu,
                                                  co.CompileSettings(True, "inductor", "max-autotune", "model")))
    assert k != compile_cache.cache_key(compile_cache.cache_key_factors(hf, torch.float32, cpu,
                                                  co.CompileSettings(True, "inductor", "default", "layer")))
    moved = copy.deepcopy(hf)
    moved._name_or_path = "/somewhere/else/tiny-llama"  # the same model in another folder: the same key
    assert k == compile_cache.cache_key(compile_cache.cache_key_factors(moved, torch.float32, cpu, base))
    moved.rms_norm_eps = 1e-3  # a real change of the model: another key
    assert k != compile_cache.cache_key(compile_cache.cache_key_factors(moved, torch.float32, cpu, base))
    assert set(compile_cache.cache_key_factors(hf, torch.float32, cpu, base)) >= {
        "model_config", "dtype", "device", "capability", "backend", "mode", "scope", "torch", "runner_core", "sources"}


def test_corrupt_cache_entry_is_discarded(tmp_path, eager, caplog):
    opt = co.CompileOptimizer(co.CompileSettings(True, "inductor", "default", "model"), tmp_path, {}, "k1")
    opt.folder.mkdir(parents=True)
    (opt.folder / compile_cache.ARTIFACTS).write_bytes(b"half-written garbage")
    (opt.folder / compile_cache.META).write_text(json.dumps({"sha256": "0" * 64}))
    opt.load_cache()
    assert opt.artifacts_cache == "rebuilt"
    assert not any((opt.folder / n).exists() for n in (compile_cache.ARTIFACTS, compile_cache.META))
    assert "is corrupt" in caplog.text
    opt.folder.mkdir(parents=True, exist_ok=True)
    (opt.folder / compile_cache.ARTIFACTS).write_bytes(b"x")  # no meta.json: also corrupt
    opt.load_cache()
    assert opt.artifacts_cache == "rebuilt"


def test_compile_error_falls_back_to_eager_or_raises(eager, monkeypatch, caplog):
    def broken(self, run, sizes):
        raise RuntimeError("simulated inductor failure")

    monkeypatch.setattr(co.CompileOptimizer, "warm_up", broken)
    stats = eager.set_compile_mode(True, backend="eager")
    assert not stats["enabled"] and "fell back to eager" in stats["reason"]
    assert "running eager instead" in caplog.text
    assert eager.generate("still fine", GREEDY)[0].finish_reason == "length"
    eager.engine.worker.config = eager.engine.worker.config.replace(compile_fallback=False)
    with pytest.raises(CompileError, match="simulated inductor failure"):
        eager.set_compile_mode(True, backend="eager")
    eager.engine.worker.config = eager.engine.worker.config.replace(compile_fallback=True)


def test_cuda_graph_trees_never_record_the_attention_op():
    """The attention op reads each step's metadata from the forward context, outside a graph's inputs: a CUDA
    graph recording it would replay its first step's pointers and grid (issue 39). Tagged cudagraph_unsafe,
    inductor (reduce-overhead, max-autotune) splits its graphs around it and runs it outside each replay."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    op = torch.ops.runner_core.paged_attention.default
    assert torch.Tag.cudagraph_unsafe in op.tags
    graph = torch.fx.Graph()
    q, k, v, cache = (graph.placeholder(name) for name in ("q", "k", "v", "kv_cache"))
    attention = graph.call_function(op, (q, k, v, cache, 2, 1, 4, 0.5))
    graph.output(attention)
    assert get_first_incompatible_cudagraph_node(torch.fx.GraphModule({}, graph)) is attention


def test_auto_mode_picks_from_the_device(monkeypatch):
    cpu = torch.device("cpu")
    s = co.CompileSettings.resolve(True, "inductor", "auto", "model", cpu)
    assert (s.backend, s.mode, s.enabled) == ("inductor", "max-autotune", True) and "C++ compiler" in s.reason
    # CUDA (issue 39): inductor without its own CUDA graphs, so the runner's decode CUDA graphs (static
    # metadata buffers, memory in the pool plan) capture the decode steps
    s = co.CompileSettings.resolve(True, "inductor", "auto", "model", torch.device("cuda"))
    assert (s.backend, s.mode) == ("inductor", "default") and s.mode not in CUDA_GRAPH_MODES
    monkeypatch.setattr(co, "has_cxx_compiler", lambda: False)
    s = co.CompileSettings.resolve(True, "inductor", "auto", "model", cpu)
    assert not s.enabled and "no C++ compiler" in s.reason


# ---- warm start (AOTInductor package), its fallback, CUDA graphs on CPU ------------------------
def test_warm_start_loads_the_package_without_tracing(compiled, tiny_llama_path):
    """On CPU with inductor the default route is an AOTInductor package: a second process
    loads it (a hit), traces nothing (no dynamo graph at all) and generates the same tokens."""
    stats = compiled.compile_stats()
    assert stats["warm_start"] == "aoti", stats["warm_start_reason"]
    assert (CACHE_DIR / stats["cache_key"] / aoti_program.AOTI_PACKAGE).exists()
    script = textwrap.dedent(f"""
        import json
        from torch._dynamo.utils import counters
        from runner_core import ModelRunner, SamplingParams
        r = ModelRunner({{"model": {str(tiny_llama_path)!r}, **{COMPILED!r}}}).load_model()
        s = r.compile_stats()
        outs = r.generate({_prompts()!r}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        print(json.dumps({{"cache": s["cache"], "route": s["warm_start"], "graphs": counters["stats"]["unique_graphs"],
                          "recompiles": r.compile_stats()["recompiles_after_warmup"],
                          "tokens": [o.token_ids for o in outs]}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (out["cache"], out["route"], out["graphs"], out["recompiles"]) == ("hit", "aoti", 0, 0)
    assert out["tokens"] == [o.token_ids for o in compiled.generate(_prompts(), GREEDY)]


def test_package_input_checks(compiled):
    """Without dynamo guards the package checks what it was built for; anything else runs eager."""
    prog = compiled.engine.worker.compiler._program
    h = compiled.engine.hf_config.hidden_size
    pos, hid = torch.arange(5), torch.randn(5, h)
    assert prog.matches((pos, hid, torch.zeros(5, h))) and prog.matches((pos[:1], hid[:1], hid[:1]))
    assert not prog.matches((pos, torch.randn(h, 5).t(), hid))  # not contiguous
    assert not prog.matches((pos, hid.double(), hid))  # another dtype
    assert not prog.matches((pos, hid[:4], hid))  # tokens disagree
    assert not prog.matches((pos, hid))  # arity


def test_corrupt_package_is_discarded(tmp_path, caplog):
    opt = co.CompileOptimizer(co.CompileSettings(True, "inductor", "default", "layer"), tmp_path, {}, "k2")
    opt.folder.mkdir(parents=True)
    (opt.folder / aoti_program.AOTI_PACKAGE).write_bytes(b"PK half a zip")
    (opt.folder / aoti_program.AOTI_META).write_text(json.dumps({"sha256": "0" * 64, "names": [], "signature": []}))
    opt.load_package()
    assert opt.cache == "rebuilt" and not (opt.folder / aoti_program.AOTI_PACKAGE).exists()
    assert "is corrupt" in caplog.text


def test_package_failure_falls_back_to_jit_and_is_remembered(eager, tmp_path, monkeypatch, caplog):
    """An AOTInductor failure switches to the torch.compile route (dynamo's eager backend here,
    to spare the suite a cold inductor compile) and is remembered for the key."""
    def broken(self, module, args, kwargs):
        raise RuntimeError("simulated export failure")

    monkeypatch.setattr(aoti_program.AOTIProgram, "build", broken)
    monkeypatch.setattr(co.CompileSettings, "options", property(lambda s: {"backend": "eager", "dynamic": True,
                                                                           "fullgraph": True}))
    eng = eager.engine
    saved = eng.worker.config
    eng.worker.config = saved.replace(compile_cache_dir=str(tmp_path))
    reference = [o.token_ids for o in eager.generate(_prompts()[:2], GREEDY)]
    try:
        stats = eager.set_compile_mode(True, backend="inductor", mode="default", scope="layer")
        assert stats["enabled"] and stats["warm_start"] == "jit"
        assert "AOTInductor failed: RuntimeError: simulated export failure" in stats["warm_start_reason"]
        assert "AOTInductor packaging failed" in caplog.text
        assert (tmp_path / stats["cache_key"] / co.AOTI_FAILED).exists()
        assert [o.token_ids for o in eager.generate(_prompts()[:2], GREEDY)] == reference
        again = eager.set_compile_mode(True, backend="inductor", mode="default", scope="layer")
        assert again["warm_start"] == "jit" and "failed for this key before" in again["warm_start_reason"]
    finally:
        eager.set_compile_mode(False)
        eng.worker.config = saved


def test_cuda_graphs_are_skipped_on_cpu(compiled, eager):
    for runner in (compiled, eager):
        assert runner.compile_stats()["cuda_graphs"].startswith("skipped: CPU device")
    assert co.cuda_graphs_status("cuda", "reduce-overhead", True).startswith("by torch.compile")
