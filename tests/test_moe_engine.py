"""MoE models through the rest of the engine: compiled (scope model, the AOTInductor route, with a
padded decode program) equals eager in tokens, router logits and per-expert counts; TP=2 and PP=2 equal
one process; the memory estimate and the parallel-layout suggestion count the expert weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from runner_core import ModelRunner, SamplingParams, suggest_parallel_config
from runner_core.memory.estimate import estimate_memory
from tests.conftest import REPO
from tests.moe_models import make_tiny_moe_model

CACHE_DIR = REPO / "test-output" / "compile-cache"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
EAGER = {"dtype": "float32", "kv_cache_memory": 1 << 22, "max_num_seqs": 8, "max_num_batched_tokens": 64}
COMPILED = {**EAGER, "compile": True, "compile_backend": "inductor", "compile_mode": "default",
            "compile_scope": "model", "compile_cache_dir": str(CACHE_DIR), "compile_sizes": [4]}


def _prompts(lengths, seed=5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _run(runner, prompts):
    """(tokens, this call's expert counts)."""
    before = torch.tensor(runner.moe_stats()["cumulative"])
    tokens = [o.token_ids for o in runner.generate(prompts, GREEDY)]
    return tokens, (torch.tensor(runner.moe_stats()["cumulative"]) - before).tolist()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe-engine"), "mixtral")


def test_compiled_moe_equals_eager_with_padded_decode_programs(mixtral):
    """One package for the whole model (experts kept as the runner_core::fused_moe op) and a static
    4-row decode program: 3 decoding sequences run it with a pad row, which is never counted."""
    eager = ModelRunner({"model": str(mixtral), **EAGER}).load_model()
    mixed, three = _prompts((1, 7, 33, 64, 2)), _prompts((9, 3, 20), seed=6)
    ids = torch.tensor([mixed[3][:20], mixed[2][:20]])
    ref = [_run(eager, mixed), _run(eager, three)], eager.forward(ids, output_router_logits=True)
    eager.shutdown()

    compiled = ModelRunner({"model": str(mixtral), **COMPILED}).load_model()
    stats = compiled.compile_stats()
    assert (stats["warm_start"], stats["scope"], stats["graph_breaks"]) == ("aoti", "model", 0), stats
    assert stats["decode_programs"]["sizes"] == [4]
    assert [_run(compiled, mixed), _run(compiled, three)] == ref[0]
    programs = compiled.compile_stats()["decode_programs"]
    assert programs["runs"][4] >= GREEDY.max_tokens - 1 and programs["padded_rows"] >= GREEDY.max_tokens - 1
    out = compiled.forward(ids, output_router_logits=True)
    torch.testing.assert_close(out["logits"], ref[1]["logits"], atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(out["router_logits"], ref[1]["router_logits"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert compiled.compile_stats()["recompiles_after_warmup"] == 0
    compiled.shutdown()


# ---- tensor and pipeline parallel ---------------------------------------------------------------
PARALLEL_LAYOUTS = {"qwen2_moe-tp2": ("qwen2_moe", 2, 1), "mixtral-pp2": ("mixtral", 1, 2)}


@pytest.fixture(scope="module", params=list(PARALLEL_LAYOUTS))
def parallel(request, tmp_path_factory):
    family, tp, pp = PARALLEL_LAYOUTS[request.param]
    path = make_tiny_moe_model(tmp_path_factory.mktemp(request.param), family)
    prompts = _prompts((5, 40, 70, 1), seed=7)
    ids = torch.tensor([prompts[1][:16], prompts[2][:16]])
    one = ModelRunner(model=str(path), **EAGER).load_model()
    ref = _run(one, prompts), one.forward(ids, output_router_logits=True)
    one.shutdown()
    runner = ModelRunner(model=str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, parallel_timeout_s=60,
                         **EAGER).load_model()
    yield path, tp, runner, prompts, ids, ref
    runner.shutdown()


def test_parallel_moe_equals_one_process(parallel):
    """Tokens, logits, router logits and per-expert counts (TP: experts sharded, one all-reduce per
    block; PP: each stage's layers gathered on rank 0)."""
    _, _, runner, prompts, ids, (ref_run, ref_fwd) = parallel
    assert _run(runner, prompts) == ref_run
    out = runner.forward(ids, output_router_logits=True)
    torch.testing.assert_close(out["logits"], ref_fwd["logits"], atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(out["router_logits"], ref_fwd["router_logits"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_parallel_ranks_hold_the_predicted_expert_shards(parallel):
    path, tp, runner, *_ = parallel
    ranks = runner.parallel_info()["ranks"]
    predicted = estimate_memory(str(path), dtype="float32", tensor_parallel_size=tp,
                                pipeline_parallel_size=len(ranks) // tp)
    assert max(r["weights_bytes"] for r in ranks) == predicted.weights_bytes


# ---- the memory plan --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_estimate_counts_the_experts(preset, tmp_path):
    tokens = 512
    runner = ModelRunner({"model": preset, "dtype": "float32", "kv_cache_memory": 8 << 20, "max_model_len": 512,
                          "max_num_seqs": 8, "max_num_batched_tokens": tokens}).load_model()
    est = estimate_memory(preset, dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=tokens,
                          kv_cache_memory=8 << 20)
    assert est.weights_bytes == runner.memory_stats()["weights_bytes"]  # experts, and the linears as stored
    measured = runner.engine.worker.measure_activation_peak(tokens, 8)
    assert abs(est.activation_peak_bytes - measured) <= 0.1 * measured, (est.activation_peak_bytes, measured)
    # from config.json alone (the per-expert names save_pretrained writes): the same weights
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(runner.engine.model_info["model_path"] + "/config.json", config_only)
    assert estimate_memory(str(config_only), dtype="float32").weights_bytes == est.weights_bytes
    runner.shutdown()


def test_suggestion_counts_the_experts():
    kw = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 256,
          "device": "cuda"}
    need = {tp: (lambda e: e.fixed_bytes + e.min_kv_pool_bytes)(estimate_memory("tiny-mixtral", tensor_parallel_size=tp,
                                                                                 **kw)) for tp in (1, 2)}
    experts = 4 * 8 * 3 * 128 * 256 * 4  # layers x experts x (w1, w3, w2) x hidden x width x fp32
    assert need[1] - need[2] > experts // 2 * 0.9  # TP=2 halves the experts
    s = suggest_parallel_config("tiny-mixtral", 2, device_memory=need[2] + 1, gpu_memory_utilization=1.0, **kw)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size, s.per_device_bytes) == (2, 1, need[2])
