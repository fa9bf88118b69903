"""Tensor and pipeline parallelism over gloo on the CPU: the same greedy tokens and logits as one
process for TP=2, PP=2 and TP=2 x PP=2 (tiny-llama and a tiny Qwen2 with qkv bias), with
continuous batching, chunked prefill, preemption and defragmentation; shards built per rank;
faults (a killed or hung worker) reported with nothing left behind; a two-"node" torchrun run;
bad layouts refused; the layout suggestion.

Spawned runners are shared per layout (a module-scoped parametrized fixture), so each layout
starts its processes once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from runner_core import ConfigError, ModelRunner, SamplingParams, WorkerError, suggest_parallel_config
from runner_core.memory import estimate_memory
from runner_core.parallel.manager import shutdown_all
from tests.helpers import make_tiny_hf_model, native_kernels_off

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# small step budget and pool: prompts are chunked, batches mix prefill and decode, tiny-llama preempts
COMMON = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64}
PARALLEL = {**COMMON, "kv_cache_memory": 1 << 20, "parallel_timeout_s": 60}
TIGHT_POOL = 16 * 16 * 1024  # llama-tp2: 16 blocks of 16 tokens at 1 KiB per token per rank
LAYOUTS = {  # id -> (model, tensor_parallel_size, pipeline_parallel_size, pipeline_stage_layers)
    "llama-tp2": ("tiny-llama", 2, 1, None),
    "llama-pp2-3+1": ("tiny-llama", 1, 2, [3, 1]),  # a configured, uneven split
    "llama-tp2xpp2": ("tiny-llama", 2, 2, None),
    "qwen2-tp2": ("qwen2", 2, 1, None),
    "qwen2-pp2": ("qwen2", 1, 2, None),
    "qwen2-tp2xpp2": ("qwen2", 2, 2, None),
}


def _prompts(n=6, seed=3, vocab=512):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


PROMPTS = _prompts()


def _children() -> dict[int, str]:
    """Live child processes of this process (from /proc), pid -> command line."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z" and "resource_tracker" not in cmd:
            out[int(entry)] = cmd
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama_path):
    return {"tiny-llama": str(tiny_llama_path), "qwen2": str(make_tiny_hf_model(tmp_path_factory.mktemp("m"), "qwen2"))}


@pytest.fixture(scope="module")
def reference(models):
    """Single-process tokens, logits and hidden states of each model, weights bytes, and the forward of one
    process multiplying with torch's GEMM (the native kernels off), as every parallel rank does."""
    out = {}
    ids, mask = _padded(PROMPTS[:3])
    for name, path in models.items():
        runner = ModelRunner(model=path, **COMMON).load_model()
        fwd = runner.forward(ids, attention_mask=mask)
        out[name] = ([o.token_ids for o in runner.generate(PROMPTS, GREEDY)], fwd["logits"], fwd["hidden_states"],
                     runner.memory_stats()["weights_bytes"])
        runner.shutdown()
        with native_kernels_off():
            runner = ModelRunner(model=path, **COMMON).load_model()
            out[name] += (runner.forward(ids, attention_mask=mask),)
            runner.shutdown()
    return out


def _padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def layout(request, models):
    model, tp, pp, split = LAYOUTS[request.param]
    settings = {**PARALLEL, "kv_cache_memory": TIGHT_POOL} if request.param == "llama-tp2" else PARALLEL
    if tp * pp == 4:
        settings = {**settings, "enable_prefix_caching": True}
    runner = ModelRunner(model=models[model], tensor_parallel_size=tp, pipeline_parallel_size=pp,
                         pipeline_stage_layers=split, **settings).load_model()
    yield request.param, model, runner
    runner.shutdown()


def test_greedy_tokens_and_logits_equal_one_process(layout, reference):
    name, model, runner = layout
    tokens, logits, hidden, _, torch_gemm = reference[model]
    outs = runner.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == tokens
    steps = list(runner.step_metrics)
    assert any(m.num_prefill_tokens and m.num_decode_tokens for m in steps), "continuous batching mixes steps"
    if name == "llama-tp2":  # 16 blocks hold one 256-token sequence, not six prompts with their outputs
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    ids, mask = _padded(PROMPTS[:3])
    fwd = runner.forward(ids, attention_mask=mask)
    if LAYOUTS[name][1] == 1:  # pipeline only: the stages run one process's layers, bit for bit
        assert torch.equal(fwd["logits"], torch_gemm["logits"])
        assert torch.equal(fwd["hidden_states"], torch_gemm["hidden_states"])
    # against one process with the native kernels: its panel GEMM and the ranks' torch GEMM round
    # differently, and tensor parallel sums partial products in another order (measured: at most
    # 6.8e-6 on logits up to 5.5)
    torch.testing.assert_close(fwd["logits"], logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(fwd["hidden_states"], hidden, rtol=0, atol=2e-5)


def test_parallel_sampling_children_share_and_copy_blocks_on_every_rank(layout, reference):
    """n=2, greedy: the children share the prompt's blocks on every rank and copy its partial last block there
    (StepBatch.block_copies) before writing; each gives one process's greedy tokens."""
    name, model, runner = layout
    prompt, expected = PROMPTS[1], reference[model][0][1]
    assert len(prompt) % 16, "a partial last block, shared then copied"
    out = runner.generate(prompt, SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    stats = runner.memory_stats()
    assert stats["blocks_free"] == stats["blocks_total"]


def test_each_rank_builds_and_reads_only_its_shard(layout, reference):
    name, model, runner = layout
    info = runner.parallel_info()
    _, tp, pp, split = LAYOUTS[name]
    full = reference[model][3]
    assert info["world_size"] == tp * pp == len(info["ranks"])
    assert len({r["pid"] for r in info["ranks"]}) == tp * pp
    layers = 4 if model == "tiny-llama" else 2
    expected_split = split or [layers // pp] * pp
    assert [b - a for a, b in info["stage_layers"]] == expected_split
    for r in info["ranks"]:
        assert r["weights_bytes"] < 0.8 * full, r
        assert 0 < r["checkpoint_bytes_read"] < 0.8 * full, r
    assert sum(r["weights_bytes"] for r in info["ranks"]) >= full * 0.99
    # every rank's pool: the same number of blocks, over its own layers and KV heads
    blocks = runner.memory_stats()["blocks_total"]
    head_dim = 32 if model == "tiny-llama" else 16
    kv_heads = max(1, 2 // tp)
    for r in info["ranks"]:
        local_layers = r["layers"][1] - r["layers"][0]
        assert r["kv_pool_bytes"] == blocks * 16 * local_layers * 2 * kv_heads * head_dim * 4, r


def test_requests_join_abort_and_defragment_mid_generation(layout, reference):
    name, model, runner = layout
    tokens = reference[model][0]
    first = runner.add_request(PROMPTS[0], GREEDY)
    doomed = runner.add_request(PROMPTS[1], GREEDY)
    for _ in range(3):
        runner.step()
    runner.abort_request(doomed)
    later = [runner.add_request(p, GREEDY) for p in PROMPTS[2:]]
    runner.step()
    runner.defragment()  # every rank moves its KV the way rank 0's block pool moved
    done = {}
    while runner.has_unfinished_requests():
        for out in runner.step():
            done[out.request_id] = out.token_ids
    assert [done[r] for r in [first, *later]] == [tokens[0], *tokens[2:]]
    comm = runner.parallel_info()["comm"]
    assert comm["calls"]["broadcast"] > 0 and comm["total_bytes"] > 0
    if runner.config.enable_prefix_caching:  # the prompts ran before: cached blocks, same KV on every rank
        assert runner.memory_stats()["prefix_cache_hit_rate"] > 0


def test_a_single_process_runner_on_another_thread_is_unaffected(layout, reference, models):
    """The parallel groups are active on the calling thread only, while the parallel runner runs."""
    name, model, runner = layout
    single = ModelRunner(model=models["tiny-llama"], **COMMON).load_model()
    results = {}

    def generate_single():
        results.update(single=[o.token_ids for o in single.generate(PROMPTS, GREEDY)])

    worker = threading.Thread(target=generate_single)
    worker.start()
    results["parallel"] = [o.token_ids for o in runner.generate(PROMPTS, GREEDY)]
    worker.join(timeout=300)
    assert results == {"single": reference["tiny-llama"][0], "parallel": reference[model][0]}


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_killed_worker_is_reported_and_nothing_is_left(layout):
    shutdown_all()
    before = set(_children())
    runner = ModelRunner(model="tiny-llama", **layout, **PARALLEL).load_model()
    worker = runner.parallel_info()["ranks"][1]["pid"]
    assert _alive(worker)
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL.*create a new ModelRunner"):
        runner.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerError, match="failed earlier"):
        runner.generate(PROMPTS[0], GREEDY)
    runner.shutdown()
    assert not _alive(worker)
    assert set(_children()) <= before


def test_hung_worker_is_detected_within_the_timeout_and_a_new_runner_works(reference):
    shutdown_all()
    before = set(_children())
    runner = ModelRunner(model="tiny-llama", tensor_parallel_size=2, **{**PARALLEL, "parallel_timeout_s": 3})
    runner.load_model()  # a new parallel runner in the same process after the previous one failed
    assert [o.token_ids for o in runner.generate(PROMPTS[:2], GREEDY)] == reference["tiny-llama"][0][:2]
    worker = runner.parallel_info()["ranks"][1]["pid"]
    os.kill(worker, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="did not answer for 3 s.*hung"):
        runner.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 3 + 10
    runner.shutdown()
    assert not _alive(worker)
    assert set(_children()) <= before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_torchrun_on_loopback_gives_the_same_tokens(reference):
    """Two torchrun launchers, --nnodes=2 --node-rank=0/1, one process each: the two pipeline
    stages on two "nodes". Rank 0 prints the outputs; rank 1 serves it and exits with it."""
    shutdown_all()
    port, prompts = _free_port(), ["Hello", "Once upon a time"]
    single = ModelRunner(model="tiny-llama", **COMMON).load_model()
    expected = [o.token_ids for o in single.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--master-addr=127.0.0.1", f"--master-port={port}"]
    args = ["-m", "runner_core", "generate", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "256", "--pipeline-parallel-size", "2", "--max-tokens", "8", "--json"]
    for p in prompts:
        args += ["--prompt", p]
    nodes = [subprocess.Popen(cmd + [f"--node-rank={n}"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n in (0, 1)]
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in results[0][0].splitlines() if x.startswith("{")]
    assert [x["token_ids"] for x in lines] == expected
    assert not results[1][0].strip()  # only rank 0 prints


# ---- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    ({"tensor_parallel_size": 8}, "tensor_parallel_size=8 does not divide num_attention_heads=4"),
    ({"pipeline_parallel_size": 5}, "pipeline_parallel_size=5 exceeds the model's 4 decoder layers"),
    ({"pipeline_parallel_size": 2, "pipeline_stage_layers": [1, 2]}, r"adds up to 3 layers but the model has 4"),
])
def test_bad_layouts_are_refused_before_any_process_starts(settings, message):
    before = set(_children())
    with pytest.raises(ConfigError, match=message):
        ModelRunner(model="tiny-llama", **{**COMMON, **settings}).load_model()
    assert set(_children()) <= before


def test_stage_split_must_match_the_stage_count():
    with pytest.raises(ConfigError, match="pipeline_stage_layers.*a list of 2 ints"):
        ModelRunner(model="tiny-llama", pipeline_parallel_size=2, pipeline_stage_layers=[4])


def test_more_ranks_than_cuda_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runner = ModelRunner(model="tiny-llama", device="cuda:0", tensor_parallel_size=2, max_model_len=256)
    with pytest.raises(ConfigError, match=r"2 x 1 = 2 ranks need one CUDA device each .* but 1 is visible"):
        runner.load_model()


# ---- the suggestion ------------------------------------------------------------------------
def _need(tp, pp, **kw):
    est = estimate_memory("small-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)
    return est.fixed_bytes + est.min_kv_pool_bytes


def test_suggestion_takes_the_fewest_devices_that_fit_and_prefers_tp():
    kw = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 256,
          "device": "cuda"}
    one, tp2, pp2 = _need(1, 1, **kw), _need(2, 1, **kw), _need(1, 2, **kw)
    assert tp2 < one and pp2 < one
    memory = (one + max(tp2, pp2)) // 2  # two devices fit either way, one does not
    s = suggest_parallel_config("small-llama", ["cuda:0"] * 4, device_memory=memory, gpu_memory_utilization=1.0, **kw)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size) == (2, 1)
    assert "fewest devices" in s.reason and "tensor parallelism is preferred" in s.reason
    assert s.as_config() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}
    assert {(c["tp"], c["pp"]) for c in s.candidates if c["fits"]} >= {(2, 1), (1, 2)}
    # TP may not span nodes: with one device per node the pipeline takes two
    s = suggest_parallel_config("small-llama", 4, device_memory=memory, gpu_memory_utilization=1.0,
                                devices_per_node=1, **kw)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size) == (1, 2)
    assert any("span nodes" in c["why"] for c in s.candidates)
    # everything fits on one device: one device
    s = suggest_parallel_config("small-llama", 4, device_memory=one * 2, gpu_memory_utilization=1.0, **kw)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size) == (1, 1)
    assert "tp=1 pp=1" in str(s)
    with pytest.raises(ConfigError, match="does not fit on 2 device"):
        suggest_parallel_config("small-llama", 2, device_memory=1 << 20, **kw)
