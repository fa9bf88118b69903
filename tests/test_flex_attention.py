"""The FlexAttention backend (pool read in place through block tables) equals the gather path, and
greedy generation with it equals transformers. On the CPU: eager flex checks the mask, the
compiled kernel also checks the BlockMask's block lists (eager flex ignores them)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.nn.attention.flex_attention import create_mask

from runner_core import ModelRunner, SamplingParams
from runner_core.errors import ConfigError
from runner_core.layers.attention import Attention, resolve_attention_backend, set_forward_context
from runner_core.layers.flex_attention import Q_BLOCK, _mask_mod, flex_paged_attention
from tests.helpers import step_metadata
from tests.test_decode_programs import _EagerAtSizes

HEADS, KV_HEADS, HEAD_DIM, BLOCK, POOL_BLOCKS = 8, 2, 16, 4, 48
# decodes (context 1..), fresh prompts, a chunk continuing a prompt whose first 13 tokens are in the pool
STARTS = [0, 6, 21, 0, 0, 13]
Q_LENS = [1, 1, 1, 5, 19, 22]
NUM_DECODES = 3


def _batch(seed: int = 0):
    """Block tables over randomly permuted (non-contiguous) pool blocks, the pool, and the step's q/k/v."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(POOL_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for start, n in zip(STARTS, Q_LENS):
        need = -(-(start + n) // BLOCK)
        tables.append(perm[used:used + need])
        used += need
    n = sum(Q_LENS)
    cache = torch.randn(2, KV_HEADS, POOL_BLOCKS * BLOCK, HEAD_DIM, generator=g)
    q = torch.randn(n, HEADS * HEAD_DIM, generator=g)
    k, v = (torch.randn(n, KV_HEADS * HEAD_DIM, generator=g) for _ in range(2))
    return tables, cache, q, k, v


def _metadata(tables, window, flex):
    assert sum(1 for n in Q_LENS if n == 1) == NUM_DECODES
    return step_metadata("flex" if flex else "gather", STARTS, Q_LENS, tables, BLOCK, window, POOL_BLOCKS)


def _attend(meta, cache, q, k, v):
    attn = Attention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS)
    attn.kv_cache = cache.clone()
    with torch.inference_mode(), set_forward_context(meta, True):
        return attn(q, k, v), attn.kv_cache


@pytest.mark.parametrize("window", [None, 7])
def test_flex_equals_gather_on_a_mixed_batch(window):
    tables, cache, q, k, v = _batch()
    ref, ref_cache = _attend(_metadata(tables, window, flex=False), cache, q, k, v)
    out, out_cache = _attend(_metadata(tables, window, flex=True), cache, q, k, v)
    torch.testing.assert_close(out_cache, ref_cache)  # both wrote the step's K/V to the same slots
    torch.testing.assert_close(out, ref)


def _listed(counts, indices):
    listed = torch.zeros(counts.shape[-1], POOL_BLOCKS, dtype=torch.bool)
    for b in range(listed.shape[0]):
        listed[b, indices[0, 0, b, : counts[0, 0, b]].long()] = True
    return listed


@pytest.mark.parametrize("window", [None, 7])
def test_block_lists_cover_the_mask(window):
    """Every (query block, pool block) pair where the mask lets some query see some key is listed,
    as partial or full, for that query block (the compiled kernels skip all others); in a full block
    every real query of the query block sees every key (the kernels skip the mask there)."""
    meta = _metadata(_batch()[0], window, flex=True)
    rows = meta.row_seq.shape[0]
    mask_mod = _mask_mod(meta.row_seq, meta.row_pos, meta.logical_of, meta.block_tables,
                         BLOCK, window)
    dense = create_mask(mask_mod, 1, 1, rows, POOL_BLOCKS * BLOCK, device="cpu")[0, 0]
    tiles = dense.view(rows // Q_BLOCK, Q_BLOCK, POOL_BLOCKS, BLOCK)
    needed = tiles.any(3).any(1)
    partial = _listed(meta.kv_num_blocks, meta.kv_indices)
    full = _listed(meta.full_kv_num_blocks, meta.full_kv_indices)
    assert needed.any(1).all()  # every query block sees something (no empty rows in the batch)
    assert not (needed & ~(partial | full)).any(), "a block the mask needs is missing from the BlockMask"
    assert not (partial & full).any()
    real = (meta.row_pos >= 0).view(rows // Q_BLOCK, Q_BLOCK)
    whole = (tiles.all(3) | ~real.unsqueeze(2)).all(1)  # every real row sees every key of the block
    assert full.any() and not (full & ~whole).any(), "a block listed full is not entirely visible"
    if window is not None:  # the window prunes: some query block skips blocks of its sequence it would see
        seen = partial | full
        assert (seen.sum(1) < torch.tensor([-(-(s + n) // BLOCK) for s, n in zip(STARTS, Q_LENS)
                                            for _ in range(-(-n // Q_BLOCK))])).any()


def test_compiled_flex_kernel_equals_gather():
    """The compiled CPU kernel visits only the listed blocks and skips the mask in full ones (about
    10-30 s of inductor compile here). A window of 20 gives prefill query blocks full blocks, partial
    ones and blocks pruned before the window."""
    window = 20
    tables, cache, q, k, v = _batch(seed=3)
    ref, _ = _attend(_metadata(tables, window, flex=False), cache, q, k, v)
    meta = _metadata(tables, window, flex=True)
    prefill_blocks = meta.full_kv_num_blocks[0, 0, NUM_DECODES:]
    assert prefill_blocks.any() and (meta.kv_num_blocks[0, 0, NUM_DECODES:] > 0).all()
    pool = cache.clone()
    with torch.inference_mode():
        k_new = k.view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        v_new = v.view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        pool[0].index_copy_(1, meta.slot_mapping, k_new)
        pool[1].index_copy_(1, meta.slot_mapping, v_new)
        out = flex_paged_attention(q.view(-1, HEADS, HEAD_DIM), pool[0], pool[1], meta, HEAD_DIM ** -0.5,
                                   compiled=True)
    torch.testing.assert_close(out.reshape(ref.shape), ref)


def test_backend_choice():
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, 16) == "native"  # the kernel builds here (test_attention_kernel)
    assert resolve_attention_backend("flex", cpu, 4) == "flex"
    with pytest.raises(ConfigError, match="'attention_backend' got 'native' on cuda.*'auto', 'flex' or 'gather'"):
        resolve_attention_backend("native", torch.device("cuda"), 16)
    with pytest.raises(ConfigError, match="block_size=8.*raise block_size"):
        resolve_attention_backend("flex", torch.device("cuda"), 8)
    with pytest.raises(ConfigError, match="'attention_backend' got 'tensorrt'; allowed: one of"):
        resolve_attention_backend("tensorrt", cpu, 16)
    with pytest.raises(ConfigError, match="'attention_backend' got 'triton'; allowed: one of 'auto', 'flex'"):
        ModelRunner({"model": "tiny-llama", "attention_backend": "triton"})


def test_engine_with_flex_equals_transformers(tiny_llama_path):
    # eager flex on the CPU costs ~0.3 s a layer call: few steps, a small pool
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 20,
                          "attention_backend": "flex", "max_num_seqs": 8, "max_num_batched_tokens": 128,
                          "max_model_len": 256})
    runner.load_model()
    fp = runner.engine.worker.forward_pass
    assert fp.attention_backend == "flex"
    # pure-decode steps run at size 4 over static-length metadata, as CUDA graphs replay them
    programs = _EagerAtSizes(runner.model, [4])
    programs.static_decode_len = fp.buffers.max_blocks * fp.block_size
    fp.decode_programs = programs
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    # the 200-token prompt is prefilled in chunks (the later ones continue from the pool, beside decodes)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 200, 17, 9)]
    outs = runner.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert any(m.num_prefill_tokens and m.num_decode_tokens for m in runner.engine.step_metrics)  # mixed steps
    assert programs.runs[4] and programs.padded_rows  # and padded static decodes
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_flex_is_warmed_up_and_profiled_over_the_pool_at_load(tiny_llama_path, monkeypatch):
    """Flex was first run by the first requests (its Triton kernels compiled then, tens of seconds on CUDA) and
    its memory never measured (issue 39). At load on CUDA the worker runs it over the pool on the busiest step and
    a second shape, keeping block 0's contents, and a pool sized from the device's memory gives back what flex's
    step peaks above the plan. Run here on the CPU (eager flex, small shapes), the peak taken as measured."""
    import dataclasses

    from runner_core.engine import worker as worker_module
    from runner_core.layers import flex_attention

    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 20,
                          "attention_backend": "flex", "max_num_seqs": 4, "max_num_batched_tokens": 32,
                          "max_model_len": 16}).load_model()
    worker = runner.engine.worker
    rows_seen = []
    flex = flex_attention.flex_paged_attention
    monkeypatch.setattr(flex_attention, "flex_paged_attention",
                        lambda q, *a, **k: rows_seen.append(q.shape[0]) or flex(q, *a, **k))
    kv = worker.memory.kv_cache
    block0 = slice(0, worker.memory.block_size)
    kv[:, :, :, block0] = 7.0  # a live sequence's keys
    block_bytes = worker.pool_plan.bytes_per_token * worker.pool_plan.block_size
    worker.pool_plan = dataclasses.replace(worker.pool_plan, source="gpu_memory_utilization", activation_peak_bytes=0)
    monkeypatch.setattr(worker_module, "profile_activation_peak", lambda run, device: run() or 3 * block_bytes)
    blocks = worker.memory.num_blocks
    worker.warm_up_attention()
    layers = runner.model.num_layers
    # the busiest step (3 decodes and a prefill cut at max_model_len: 3 + 16 tokens), then another shape
    assert rows_seen[:layers] == [19] * layers and len(set(rows_seen)) == 2
    assert bool((worker.memory.kv_cache[:, :, :, block0] == 7.0).all())  # block 0 as it was
    assert worker.memory.num_blocks == blocks - 3 == worker.pool_plan.num_blocks
    assert worker.memory.kv_cache.shape[3] == (blocks - 3) * worker.memory.block_size
    out = runner.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 2
