"""The native paged decode kernel equals the pure-torch gather path it replaces."""

from __future__ import annotations

import pytest
import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.engine import InputBuffers
from runner_core.engine.forward_pass import build_metadata
from runner_core.kernels import cpu_kernels_available
from runner_core.layers.attention import Attention, set_forward_context


def test_kernel_builds():
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_gather_path(window, dtype):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 32, 4, 64
    ctx = [1, 5, 17, 33, 4]
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in ctx:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim).to(dtype)
    q = torch.randn(len(ctx), heads * head_dim).to(dtype)
    attn = Attention(heads, head_dim, head_dim ** -0.5, kv_heads)
    k_new = torch.randn(len(ctx), kv_heads * head_dim).to(dtype)
    v_new = torch.randn(len(ctx), kv_heads * head_dim).to(dtype)
    # the step's own K/V go to spare blocks no table points at, so both paths read the same pool
    spare = [b * block_size + o for b in perm[-2:] for o in range(block_size)][: len(ctx)]
    results = []
    for kernel in (False, True):
        filled = InputBuffers(16, 8, 16, torch.device("cpu")).fill([0] * len(ctx), [n - 1 for n in ctx],
                                                                   [1] * len(ctx), tables, block_size)
        _, meta = build_metadata([n - 1 for n in ctx], [1] * len(ctx), len(ctx), block_size, window,
                                 decode_kernel=kernel, filled=filled)
        meta.slot_mapping = torch.tensor(spare)
        attn.kv_cache = cache.clone()
        with set_forward_context(meta, True):
            results.append(attn(q, k_new, v_new))
    tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1].float(), results[0].float(), **tol)


def test_engine_tokens_equal_with_and_without_kernel(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    prompts = [[5] * 3, list(range(3, 70)), [9, 8, 7]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert runner.engine.worker.forward_pass.decode_kernel
    with_kernel = [o.token_ids for o in runner.generate(prompts, params)]
    runner.engine.worker.forward_pass.decode_kernel = False
    assert [o.token_ids for o in runner.generate(prompts, params)] == with_kernel
