"""The panel GEMM kernel (kernels/tier.cpp) against F.linear on every kernel tier this CPU runs, in
float32 and bfloat16, and its use by the layers: every float32 and bfloat16 CPU linear and LM head
of a single-process runner multiplies its panel copy, eager and in compiled graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear, panels_support
from runner_core.layers import linear, weight_storage
from runner_core.layers.embedding import ParallelLMHead


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


DTYPES = [torch.float32, torch.bfloat16]


# rows: every tier's register tiles (12 rows on AVX512, 6 and 4 on AVX2, their tails) and several
# tiles; n: partial and whole panels, pairs of panels and an odd panel out; k odd (bfloat16 takes k in pairs)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 11, 12, 13, 25, 64])
@pytest.mark.parametrize("n, k", [(1, 7), (16, 96), (37, 33), (48, 20), (160, 512)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_equals_linear(tier, rows, n, k, bias, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = panel_linear(x, pack_panels(w), n, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    # the float32 product of the same (rounded) inputs; bfloat16 output is it rounded once
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, atol=tol * k ** 0.5, rtol=tol)


def test_panel_linear_with_several_threads_equals_one(tier):
    x, w = torch.randn(33, 256), torch.randn(1000, 256)
    panels, before = pack_panels(w), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panel_linear(x, panels, 1000, None)
        torch.set_num_threads(2)
        two = panel_linear(x, panels, 1000, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output column is computed by one thread in the same order


def test_panel_linear_refuses_what_it_cannot_multiply():
    panels = pack_panels(torch.zeros(20, 8))
    with pytest.raises(RuntimeError, match="panels must be pack_panels of an"):
        panel_linear(torch.zeros(1, 9), panels, 20, None)
    with pytest.raises(RuntimeError, match="panels must be pack_panels of an"):
        panel_linear(torch.zeros(1, 8), panels, 40, None)
    with pytest.raises(RuntimeError, match="in the panels' dtype"):
        panel_linear(torch.zeros(1, 8, dtype=torch.bfloat16), panels, 20, None)
    with pytest.raises(RuntimeError, match="bias must be \\[n\\] in x's dtype"):
        panel_linear(torch.zeros(1, 8), panels, 20, torch.zeros(20, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="pack_panels: a \\[n, k\\] weight"):
        pack_panels(torch.zeros(2, 4, 4))
    with pytest.raises(RuntimeError, match="no panel kernel for Half"):
        pack_panels(torch.zeros(4, 4, dtype=torch.float16))
    assert panels_support(torch.float32) and panels_support(torch.bfloat16)  # on every tier
    assert not panels_support(torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_multiply_their_panels_in_eager_and_in_compiled_graphs(tier, monkeypatch, dtype):
    layer = linear.RowParallelLinear(24, 40, bias=True).to(dtype)
    head = ParallelLMHead(50, 24).to(dtype)
    for p in (layer.weight, layer.bias, head.weight):
        torch.nn.init.normal_(p)
    x = torch.randn(5, 24, dtype=dtype)
    plain = layer(x), head.compute_logits(x)
    model = torch.nn.Sequential(layer, head)
    assert weight_storage.plan_storage(model, dtype, True, None, False) == {}
    weight_storage.finish_storage(model)
    assert not any("weight" in dict(m.named_parameters(recurse=False)) for m in (layer, head))  # one copy: the panels
    assert layer.storage.kind == head.storage.kind == "panels"
    assert weight_storage.stored_bytes(model) == (48 * 24 + 64 * 24) * dtype.itemsize
    assert weight_storage.panel_bytes(40, 24, dtype) + weight_storage.panel_bytes(50, 24, dtype) == \
        (48 * 24 + 64 * 24) * dtype.itemsize
    # a traced graph holds the op itself (opaque, with its registered output shape)
    graph = torch.export.export(layer, (x,)).graph_module.code
    assert "runner_kernels.panel_linear" in graph and "aten.linear" not in graph
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2 ** -7}  # F.linear rounds differently
    torch.testing.assert_close(compiled(x), layer(x))
    calls = []
    real = weight_storage.panel_linear
    monkeypatch.setattr(weight_storage, "panel_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.testing.assert_close(layer(x), plain[0], **tol)
    torch.testing.assert_close(head.compute_logits(x), plain[1], **tol)
    torch.testing.assert_close(layer(x.view(1, 5, 24)), plain[0].view(1, 5, 40), **tol)  # any leading shape
    assert calls == [(5, 24), (5, 24), (5, 24)]


def test_panels_only_for_a_cpu_runner_in_one_process_in_a_native_dtype():
    assert weight_storage.panels_apply("cpu", torch.float32, 1)
    assert weight_storage.panels_apply("cpu", torch.bfloat16, 1)
    assert not weight_storage.panels_apply("cpu", torch.float16, 1)
    assert not weight_storage.panels_apply("cpu", torch.float32, 2)
    assert not weight_storage.panels_apply("meta", torch.float32, 1)
