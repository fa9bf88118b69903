"""The panel GEMM kernel (kernels/panel_linear_cpu.cpp) against F.linear, and its use by the layers:
every float32 CPU linear and LM head of a single-process runner multiplies its panel copy, eager
and in compiled graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear
from runner_core.layers import linear
from runner_core.layers.embedding import ParallelLMHead


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


# rows: every register tile (6, the tails 1-5) and several tiles; n: partial and whole panels; k odd
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n, k", [(1, 7), (16, 96), (37, 33), (160, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = panel_linear(x, pack_panels(w), n, b)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_panel_linear_with_several_threads_equals_one():
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
    with pytest.raises(RuntimeError, match="float32"):
        panel_linear(torch.zeros(1, 8, dtype=torch.bfloat16), panels, 20, None)
    with pytest.raises(RuntimeError, match="float32"):
        pack_panels(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_layers_multiply_their_panels_in_eager_and_in_compiled_graphs(monkeypatch):
    layer = linear.RowParallelLinear(24, 40, bias=True)
    head = ParallelLMHead(50, 24)
    for p in (layer.weight, layer.bias, head.weight):
        torch.nn.init.normal_(p)
    x = torch.randn(5, 24)
    plain = layer(x), head.compute_logits(x)
    model = torch.nn.Sequential(layer, head)
    assert linear.pack_panel_weights(model) == (48 * 24 + 64 * 24) * 4
    # a traced graph holds the op itself (opaque, with its registered output shape)
    graph = torch.export.export(layer, (x,)).graph_module.code
    assert "runner_kernels.panel_linear" in graph and "aten.linear" not in graph
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), plain[0])
    calls = []
    real = linear.panel_linear
    monkeypatch.setattr(linear, "panel_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.testing.assert_close(layer(x), plain[0])
    torch.testing.assert_close(head.compute_logits(x), plain[1])
    torch.testing.assert_close(layer(x.view(1, 5, 24)), plain[0].view(1, 5, 40))  # any leading shape
    assert calls == [(5, 24), (5, 24), (5, 24)]


def test_panels_only_for_a_float32_cpu_runner_in_one_process():
    assert linear.panels_apply("cpu", torch.float32, 1)
    assert not linear.panels_apply("cpu", torch.bfloat16, 1)
    assert not linear.panels_apply("cpu", torch.float32, 2)
    assert not linear.panels_apply("meta", torch.float32, 1)
