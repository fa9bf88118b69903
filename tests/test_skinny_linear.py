"""The streaming small-batch linear kernel (kernels/skinny_linear_cpu.cpp) against F.linear, and its
use by the linear layers: eager float32 CPU steps of at most SKINNY_MAX_ROWS rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner_core.kernels import cpu_kernels_available, skinny_linear
from runner_core.layers import linear


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 5, 64, 131])  # not only multiples of the kernel's four columns
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear(dtype, tol, rows, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(n, 96, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = skinny_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)


def test_skinny_linear_refuses_mismatched_shapes():
    with pytest.raises(RuntimeError, match=r"x \[rows, k\] and weight \[n, k\]"):
        skinny_linear(torch.zeros(1, 8), torch.zeros(4, 9), None)


def test_linear_layers_take_the_kernel_only_for_small_eager_float32_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(linear, "skinny_linear", lambda x, w, b: calls.append(x.shape[0]) or F.linear(x, w, b))
    layer = linear.ColumnParallelLinear(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    for rows in (1, linear.SKINNY_MAX_ROWS, linear.SKINNY_MAX_ROWS + 1):
        layer(torch.randn(rows, 16))
    layer(torch.randn(1, 1, 16))  # not a flat batch: the plain path
    layer.to(torch.bfloat16)(torch.randn(1, 16, dtype=torch.bfloat16))
    assert calls == [1, linear.SKINNY_MAX_ROWS]
