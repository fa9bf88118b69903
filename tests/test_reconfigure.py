"""ModelRunner.reconfigure: scheduler limits, the KV pool and the compile mode change on a loaded runner
without reloading a weight, and it then generates what a fresh runner with the new config generates;
fields that need a reload, bad values and a busy engine are refused and leave the runner working."""

from __future__ import annotations

import random
import weakref

import pytest

from runner_core import ConfigError, EngineBusyError, ModelRunner, SamplingParams
from runner_core.config import RECONFIGURABLE
from runner_core.memory import MemoryManager

BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny-llama, fp32: layers x (K, V) x kv heads x head_dim x 4 bytes
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
_rnd = random.Random(7)
PROMPTS = [[_rnd.randrange(3, 512) for _ in range(_rnd.randrange(4, 70))] for _ in range(6)]


def _config(path, **kw) -> dict:
    return {"model": str(path), "dtype": "float32", "max_model_len": 256, "block_size": 16,
            "kv_cache_memory": 128 * 16 * BYTES_PER_TOKEN, **kw}


def _tokens(runner) -> list[list[int]]:
    return [o.token_ids for o in runner.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def expected(tiny_llama_path):
    return _tokens(ModelRunner(_config(tiny_llama_path)).load_model())


def _pool_figures(runner) -> tuple:
    stats = runner.memory_stats()
    return stats["kv_pool_bytes"], stats["blocks_total"], stats["block_size"], runner.kv_block_map()["num_blocks"]


CHANGES = {
    "block_size": ({"block_size": 8}, "pool"),
    "kv_cache_memory": ({"kv_cache_memory": 40 * 16 * BYTES_PER_TOKEN}, "pool"),
    "block_size+kv_budget": ({"block_size": 32, "kv_cache_memory": 20 * 32 * BYTES_PER_TOKEN}, "pool"),
    "prefix_caching": ({"enable_prefix_caching": True}, "pool"),
    "max_num_seqs": ({"max_num_seqs": 2}, "scheduler"),
    "token_budget": ({"max_num_batched_tokens": 24, "max_num_seqs": 4}, "scheduler"),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_change_gives_what_a_fresh_runner_with_the_new_config_gives(tiny_llama_path, expected, name):
    fields, rebuilt = CHANGES[name]
    runner = ModelRunner(_config(tiny_llama_path)).load_model()
    assert _tokens(runner) == expected
    weights = list(runner.model.parameters())
    result = runner.reconfigure(**fields)
    fresh = ModelRunner(_config(tiny_llama_path, **fields)).load_model()
    assert result["rebuilt"] == rebuilt
    before = ModelRunner(_config(tiny_llama_path)).config
    assert result["changed"] == {k: [getattr(before, k), getattr(fresh.config, k)] for k in fields}
    assert runner.config == fresh.config and runner.engine.config == runner.engine.worker.config == fresh.config
    assert _pool_figures(runner) == _pool_figures(fresh)
    assert result["kv_tokens"] == fresh.engine.worker.pool_plan.num_tokens
    assert _tokens(runner) == _tokens(fresh) == expected
    assert all(a is b for a, b in zip(runner.model.parameters(), weights, strict=True))  # no weight reloaded


def test_the_scheduler_honours_a_new_max_num_seqs(tiny_llama_path, expected):
    runner = ModelRunner(_config(tiny_llama_path)).load_model()
    assert _tokens(runner) == expected
    assert max(m.num_seqs for m in runner.step_metrics) == len(PROMPTS)
    runner.reconfigure(max_num_seqs=2)
    seen = len(runner.step_metrics)
    assert _tokens(runner) == expected
    steps = list(runner.step_metrics)[seen:]
    assert max(m.num_seqs for m in steps) == 2
    runner.reconfigure(max_num_seqs=8)
    seen = len(runner.step_metrics)
    assert _tokens(runner) == expected
    assert max(m.num_seqs for m in list(runner.step_metrics)[seen:]) == len(PROMPTS)


def test_a_pool_rebuild_releases_the_old_pool_first(tiny_llama_path, monkeypatch):
    runner = ModelRunner(_config(tiny_llama_path, enable_prefix_caching=True)).load_model()
    runner.generate(PROMPTS[:2], GREEDY)
    assert runner.memory_stats()["blocks_cached"] > 0
    old = weakref.ref(runner.engine.memory.kv_cache)
    old_alive_at_allocation = []
    allocate = MemoryManager.allocate_kv_cache

    def spy(self, *args):
        old_alive_at_allocation.append(old() is not None)
        return allocate(self, *args)

    monkeypatch.setattr(MemoryManager, "allocate_kv_cache", spy)
    result = runner.reconfigure(kv_cache_memory=64 * 16 * BYTES_PER_TOKEN)
    assert old_alive_at_allocation == [False]  # the two pools never coexist: memory does not double
    assert old() is None  # nothing (layers, manager, forward pass) holds the old tensor
    assert result["prefix_cache_dropped"] is True
    stats = runner.memory_stats()
    assert stats["kv_pool_bytes"] == 64 * 16 * BYTES_PER_TOKEN
    assert stats["blocks_cached"] == 0 and stats["blocks_free"] == stats["blocks_total"] == 64
    assert runner.engine.scheduler.memory is runner.engine.memory is runner.engine.observer.memory


def test_an_unchanged_value_rebuilds_nothing(tiny_llama_path):
    runner = ModelRunner(_config(tiny_llama_path)).load_model()
    pool = runner.engine.memory.kv_cache
    result = runner.reconfigure(block_size=16, max_num_seqs=256, dtype="fp32")  # dtype as it is: no reload
    assert result["changed"] == {} and result["rebuilt"] == "none"
    assert runner.engine.memory.kv_cache is pool


def test_the_live_fields_are_the_contracts():
    assert RECONFIGURABLE == {
        "scheduler": ("max_num_seqs", "max_num_batched_tokens", "speculative_config"),
        "pool": ("block_size", "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching"),
        "compile": ("compile", "compile_backend", "compile_mode", "compile_scope", "enforce_eager")}


REFUSED = [
    ({"dtype": "bfloat16"}, ConfigError, r"'dtype' cannot change on a loaded runner: it needs a reload: "
                                         r"ModelRunner\(\{\.\.\., 'dtype': 'bfloat16'\}\)"),
    ({"max_model_len": 128}, ConfigError, r"'max_model_len' .*needs a reload"),
    ({"block_size": 3}, ConfigError, r"'block_size' got 3; allowed: one of 1, 2, 4"),
    ({"max_num_seqs": 0}, ConfigError, r"'max_num_seqs' got 0; allowed: an int >= 1"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, ConfigError, r"'max_num_batched_tokens' got 32"),
    ({"max_num_seq": 4}, ConfigError, r"unknown config key 'max_num_seq'; did you mean 'max_num_seqs'"),
    ({"kv_cache_memory": 8 * 16 * BYTES_PER_TOKEN}, ConfigError,
     r"'kv_cache_memory' got 262144: .* holds 128 tokens, fewer than one max_model_len=256 .* at least 524288 bytes"),
]


@pytest.mark.parametrize(("fields", "error", "message"), REFUSED, ids=[next(iter(f)) + "-" + str(next(iter(f.values())))
                                                                        for f, _, _ in REFUSED])
def test_refused_changes_name_the_problem_and_leave_the_runner_working(tiny_llama_path, expected, fields, error,
                                                                       message):
    runner = ModelRunner(_config(tiny_llama_path)).load_model()
    before, pool = runner.config, _pool_figures(runner)
    with pytest.raises(error, match=message):
        runner.reconfigure(**fields)
    assert runner.config == before == runner.engine.config == runner.engine.worker.config
    assert _pool_figures(runner) == pool
    assert _tokens(runner) == expected


def test_a_busy_engine_is_refused_and_keeps_its_requests(tiny_llama_path, expected):
    runner = ModelRunner(_config(tiny_llama_path)).load_model()
    rid = runner.add_request(PROMPTS[0], GREEDY)
    runner.step()
    with pytest.raises(EngineBusyError, match="cannot reconfigure the runner while requests are running"):
        runner.reconfigure(block_size=8)
    assert runner.config.block_size == 16
    tokens = []
    while runner.has_unfinished_requests():
        tokens += [o.token_ids for o in runner.step() if o.finished and o.request_id == rid]
    assert tokens == [expected[0]]
    assert runner.reconfigure(block_size=8)["rebuilt"] == "pool"
    assert _tokens(runner) == expected


def test_a_compiled_runner_keeps_its_decode_programs_across_a_pool_change(compiled_tiny_llama, tiny_llama_path):
    """The session's compiled runner (its compile is shared; this test puts every setting back): the CPU
    decode programs take the pool per call, so a block size change keeps them; a max_num_seqs below a
    program's size rebuilds them from the compile cache; compile off and on again goes through the
    compile switch. Tokens equal an eager runner's throughout, with no recompile."""
    runner, prompts = compiled_tiny_llama, PROMPTS[:3]  # three decodes run at the size-4 program
    eager = ModelRunner(_config(tiny_llama_path, block_size=8)).load_model()
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    programs = runner.engine.worker.forward_pass.decode_programs
    before = runner.config
    try:
        assert runner.reconfigure(block_size=8)["rebuilt"] == "pool"
        assert runner.engine.worker.forward_pass.decode_programs is programs and programs.sizes == [1, 4]
        runs = programs.runs[4]
        assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == want
        assert programs.runs[4] > runs
        assert runner.reconfigure(max_num_seqs=2)["rebuilt"] == "scheduler"
        assert runner.engine.worker.forward_pass.decode_programs.sizes == [1]
        assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == want
        assert runner.reconfigure(compile=False)["rebuilt"] == "compile"
        assert not runner.compile_stats()["enabled"] and runner.engine.worker.forward_pass.decode_programs is None
        assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == want
    finally:
        runner.reconfigure(**{k: getattr(before, k) for k in ("compile", "block_size", "max_num_seqs")})
    assert runner.config == before and runner.engine.worker.forward_pass.decode_programs.sizes == [1, 4]
    assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == want
    # compile back on warmed up anew (the count restarts there; the shared runner's earlier users may have
    # left some): the generation after it recompiled nothing
    assert runner.compile_stats()["recompiles_after_warmup"] == 0


def test_a_tensor_parallel_runner_reconfigures_every_rank(tiny_llama_path, expected):
    """TP=2 over gloo: each rank attends over its own pool shard with its own block size, so a rank left
    at the old block size or pool would read the wrong slots and change the tokens."""
    runner = ModelRunner(_config(tiny_llama_path, device="cpu", tensor_parallel_size=2, kv_cache_memory=1 << 19,
                                 parallel_timeout_s=60)).load_model()
    try:
        assert _tokens(runner) == expected
        result = runner.reconfigure(block_size=8, kv_cache_memory=1 << 18, max_num_seqs=2)
        assert result["rebuilt"] == "pool" and result["kv_tokens"] == 256  # 1 KiB per token on each rank
        assert runner.kv_block_map()["block_size"] == 8
        assert runner.memory_stats()["kv_pool_bytes"] == 1 << 18
        assert _tokens(runner) == expected
    finally:
        runner.shutdown()
