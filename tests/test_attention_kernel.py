"""The native paged attention kernel (decode and prefill rows over the pool in place), on every kernel
tier this CPU runs, equals the pure-torch gather path it replaces."""

from __future__ import annotations

import pytest
import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.kernels import cpu_kernels_available, native_paged_attention
from runner_core.layers.attention import Attention, set_forward_context
from runner_core.layers.native_attention import NativeMetadata
from tests.helpers import step_metadata


@pytest.fixture(autouse=True, scope="module")
def built():
    """Every test here needs the kernels (the native backend and the op), run alone or not."""
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


# (first new position, new tokens) per sequence, decodes first: pure decode; decodes with a fresh
# prompt, a prompt's later chunk and a 20-token chunk (more than one work item of the kernel)
CASES = {"decode": [(0, 1), (4, 1), (16, 1), (32, 1), (3, 1)],
         "mixed": [(4, 1), (32, 1), (0, 9), (12, 5), (3, 20)]}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_kernel_matches_gather_path(tier, case, window, dtype):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 32, 4, 64
    starts, q_lens = [s for s, _ in CASES[case]], [n for _, n in CASES[case]]
    num_decodes, n = sum(1 for c in q_lens if c == 1), sum(q_lens)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for start, count in zip(starts, q_lens):
        nb = -(-(start + count) // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim).to(dtype)
    q = torch.randn(n, heads * head_dim).to(dtype)
    attn = Attention(heads, head_dim, head_dim ** -0.5, kv_heads)
    k_new = torch.randn(n, kv_heads * head_dim).to(dtype)
    v_new = torch.randn(n, kv_heads * head_dim).to(dtype)
    results = []
    assert q_lens[:num_decodes] == [1] * num_decodes
    for kernel in (False, True):
        meta = step_metadata("native" if kernel else "gather", starts, q_lens, tables, block_size, window)
        assert isinstance(meta, NativeMetadata) == kernel
        attn.kv_cache = cache.clone()
        with set_forward_context(meta, True):
            results.append(attn(q, k_new, v_new))
    # bfloat16 and float16 outputs (up to ~2.6) differ by one unit in the last place (measured); bounds ~2 units
    tol = {torch.bfloat16: dict(atol=2e-2, rtol=1e-2), torch.float16: dict(atol=2e-3, rtol=1e-3)}.get(
        dtype, dict(atol=1e-5, rtol=1e-5))
    torch.testing.assert_close(results[1].float(), results[0].float(), **tol)


def test_engine_tokens_equal_with_and_without_kernel(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    prompts = [[5] * 3, list(range(3, 70)), [9, 8, 7]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert runner.engine.worker.forward_pass.decode_kernel
    with_kernel = [o.token_ids for o in runner.generate(prompts, params)]
    runner.engine.worker.forward_pass.decode_kernel = False
    assert [o.token_ids for o in runner.generate(prompts, params)] == with_kernel


def test_native_kernel_refuses_rows_without_a_sequence_or_length():
    q, cache = torch.zeros(3, 2, 8), torch.zeros(1, 16, 8)
    tables, two = torch.zeros(1, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="row_seq and context_lens need one entry per query row"):
        native_paged_attention(torch.empty_like(q), q, cache, cache, tables, two, torch.ones(3, dtype=torch.long),
                               4, 1.0, None)
