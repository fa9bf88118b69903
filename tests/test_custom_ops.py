"""Every custom op of the project passes `torch.library.opcheck` on small realistic inputs: its
schema declares what it mutates (an op that writes an argument the schema calls read-only gives
compiled and AOTInductor graphs a wrong picture of their inputs), its fake implementation gives the
real output's shape and dtype, and it traces under AOT dispatch with dynamic shapes.

The ops: runner_core::paged_attention (writes the step's K/V into the pool), fused_moe,
packed_linear, merge_multimodal, and the native kernels' runner_kernels::paged_attention (writes
`out`), panel_linear, pack_panels and argmax_rows (the kernels' ops on every kernel tier this CPU runs)."""

from __future__ import annotations

import pytest
import torch

import runner_core.models.llava  # noqa: F401  registers runner_core::merge_multimodal
from runner_core.kernels import cpu_kernels_available
from runner_core.layers.attention import set_forward_context
from runner_core.layers.fused_moe import fused_moe_op  # noqa: F401  registers runner_core::fused_moe
from runner_core.layers.linear import packed_linear  # noqa: F401  registers runner_core::packed_linear
from tests.helpers import stateless_metadata, step_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 16
# (first new position, new tokens) per sequence, decodes first: two decodes, a fresh prompt and a later chunk
STARTS, Q_LENS = [5, 9], [1, 1]
MIXED_STARTS, MIXED_Q_LENS = [5, 9, 0, 4], [1, 1, 6, 3]


@pytest.fixture(scope="module")
def kernels():
    """The runner_kernels ops exist only once the native kernels are built (gcc and ninja are project
    requirements)."""
    assert cpu_kernels_available(), "the native CPU kernels did not build; see the warning logged above"


def _step(starts, q_lens, decode_kernel: bool):
    """The metadata of a step over the pool (sequence i owns blocks 4i..4i+3) and its q, k, v."""
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(starts))]
    n = sum(q_lens)
    meta = step_metadata("native" if decode_kernel else "gather", starts, q_lens, tables, BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h * HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    return meta, q, k, v


def _pool():
    return torch.randn(2, KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["gather", "native"])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_paged_attention(backend, mixed, request):
    """The op writes the step's keys and values into the pool: its schema must say so."""
    if backend == "native":
        request.getfixturevalue("kernels")
    starts, q_lens = (MIXED_STARTS, MIXED_Q_LENS) if mixed else (STARTS, Q_LENS)
    meta, q, k, v = _step(starts, q_lens, decode_kernel=backend == "native")
    pool = _pool()
    with set_forward_context(meta, True):
        torch.library.opcheck(torch.ops.runner_core.paged_attention.default,
                              (q, k, v, pool, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5))


def test_paged_attention_stateless():
    """Without the pool (a stateless forward) it attends over the step's own tokens."""
    _, q, k, v = _step(MIXED_STARTS[2:], MIXED_Q_LENS[2:], decode_kernel=False)
    meta = stateless_metadata(MIXED_Q_LENS[2:], BLOCK_SIZE)
    with set_forward_context(meta, False):
        torch.library.opcheck(torch.ops.runner_core.paged_attention.default,
                              (q, k, v, torch.empty(0), HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5))


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe(renormalize):
    g = torch.Generator().manual_seed(2)
    tokens, hidden, inter, experts = 7, 16, 24, 4
    args = (torch.randn(tokens, hidden, generator=g), torch.randn(tokens, experts, generator=g),
            torch.randn(experts, 2 * inter, hidden, generator=g) / 4,
            torch.randn(experts, hidden, inter, generator=g) / 4)
    torch.library.opcheck(torch.ops.runner_core.fused_moe.default, (*args, 2, renormalize))


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's packed GEMM needs a torch built with MKL")
def test_packed_linear():
    """opcheck clones every tensor input, and a copy of MKL's packed weight (an opaque tensor whose
    layout depends on its address) is not a packed weight, so its checks are made here on the
    original: the schema's (x and weight come back unchanged) and AOT dispatch's (traced with fake
    tensors and dynamic shapes, it gives eager's output)."""
    from functorch.compile import aot_function, nop

    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(48, 32, generator=g), torch.randn(1, 32, generator=g)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
    op = torch.ops.runner_core.packed_linear.default
    x0, w0 = x.clone(), weight.clone()
    out = op(x, packed, weight)
    torch.testing.assert_close(out, x @ weight.T)
    assert torch.equal(x, x0) and torch.equal(weight, w0)
    traced = aot_function(lambda a, p, w: op(a, p, w), nop, nop, dynamic=True)(x, packed, weight)
    assert traced.shape == out.shape and traced.dtype == out.dtype
    torch.testing.assert_close(traced, out)


def test_merge_multimodal():
    embeds = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    meta = stateless_metadata([6], BLOCK_SIZE)
    with set_forward_context(meta, False, (torch.tensor([1, 2]), torch.ones(2, 16))):
        torch.library.opcheck(torch.ops.runner_core.merge_multimodal.default, (embeds,))
    with set_forward_context(meta, False):
        torch.library.opcheck(torch.ops.runner_core.merge_multimodal.default, (embeds,))


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_native_paged_attention_kernel(kernels, tier, mixed):
    """The kernel's schema marks `out` as written (Tensor(a!)) and nothing else."""
    starts, q_lens = (MIXED_STARTS, MIXED_Q_LENS) if mixed else (STARTS, Q_LENS)
    meta, q, _, _ = _step(starts, q_lens, decode_kernel=True)
    pool = _pool()
    q = q.view(-1, HEADS, HEAD_DIM)
    torch.library.opcheck(torch.ops.runner_kernels.paged_attention.default,
                          (torch.empty_like(q), q, pool[0], pool[1], meta.block_tables, meta.row_seq, meta.context_lens,
                           BLOCK_SIZE, HEAD_DIM ** -0.5, 0))


PANEL_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear(kernels, tier, bias, dtype):
    from runner_core.kernels import pack_panels

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 25, generator=g).to(dtype)  # 40 columns: two full panels of 16 and a padded one
    args = (torch.randn(3, 25, generator=g).to(dtype), pack_panels(weight), 40,
            torch.randn(40, generator=g).to(dtype) if bias else None)
    torch.library.opcheck(torch.ops.runner_kernels.panel_linear.default, args)


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_pack_panels(kernels, dtype):
    weight = torch.randn(40, 25, generator=torch.Generator().manual_seed(6)).to(dtype)
    torch.library.opcheck(torch.ops.runner_kernels.pack_panels.default, (weight,))


def test_argmax_rows(kernels, tier):
    torch.library.opcheck(torch.ops.runner_kernels.argmax_rows.default,
                          (torch.randn(3, 100, generator=torch.Generator().manual_seed(7)),))
