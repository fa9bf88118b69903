"""Greedy sampling's native argmax (kernels/argmax_row.h) equals torch.argmax on every kernel tier this
CPU runs: first index of the maximum on ties, first NaN of a row holding one, any vocabulary size."""

from __future__ import annotations

import pytest
import torch

from runner_core.kernels import argmax_rows, cpu_kernels_available
from runner_core.layers.sampler import greedy


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


@pytest.mark.parametrize("rows, vocab", [(0, 5), (1, 1), (3, 15), (5, 16), (7, 33), (32, 32000)])
def test_equals_torch_argmax(tier, rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_inf_rows_as_torch_has_them(tier):
    x = torch.zeros(6, 40)
    x[0, [3, 17, 35]] = 2.0  # a tie: the first index
    x[1, [5, 30]] = float("nan")  # NaN wins, the first one
    x[1, 0] = float("inf")
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 39] = float("inf")  # in the scalar tail
    x[4, 33] = float("nan")
    x[5] = -1.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).tolist() == [3, 5, 0, 39, 33, 0]


def test_non_contiguous_rows_and_the_sampler_entry(tier):
    x = torch.randn(40, 64)[::2, 1:60]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(greedy(x), x.argmax(dim=-1))


def test_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="float32 \\[rows, vocab\\]"):
        argmax_rows(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="vocab > 0"):
        argmax_rows(torch.zeros(2, 0))
