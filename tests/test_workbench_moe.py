"""The expert-load heat map: a pure chart over metrics rows, the rows the session folds from an MoE
model's step records, and both views drawing it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import plotly.graph_objects as go
import plotly.io as pio
import torch

from workbench import Session
from workbench.runtime.metrics import StepAccumulator
from workbench.views import charts
from workbench.views.controller import ViewController
from workbench.views.layout import CHART_NAMES
from workbench.views.widgets import FIGURES


def _valid(fig: go.Figure) -> dict:
    go.Figure(fig.to_dict())
    return json.loads(pio.to_json(fig))


def test_empty_and_dense_histories_give_a_note():
    for rows in ([], [{"t": 0.0, "steps": 3, "decode_tokens": 3}]):
        spec = _valid(charts.expert_load(rows))
        assert spec["data"] == [] and "load an MoE model" in spec["layout"]["annotations"][0]["text"]


def test_heat_map_sums_the_window():
    rows = [{"t": 0.0, "expert_counts": [[100, 0, 0], [0, 0, 100]], "moe_layers": [1, 3]},  # outside the window
            {"t": 9.0, "expert_counts": [[1, 2, 3], [4, 5, 6]], "moe_layers": [1, 3]},
            {"t": 9.5, "steps": 1},  # no routing in this row
            {"t": 10.0, "expert_counts": [[1, 0, 1], [0, 2, 0]], "moe_layers": [1, 3]}]
    fig = charts.expert_load(rows, window=5.0)
    _valid(fig)
    (heat,) = fig.data
    assert heat.type == "heatmap" and [list(r) for r in heat.z] == [[2, 2, 4], [4, 7, 6]]
    assert list(heat.y) == ["layer 1", "layer 3"] and list(heat.x) == ["e0", "e1", "e2"]
    assert "25 routed tokens" in fig.layout.title.text and "2 MoE layers x 3 experts" in fig.layout.title.text


def test_accumulator_folds_step_counts_into_rows():
    acc = StepAccumulator("m", 0.0)
    base = dict(num_prefill_tokens=4, num_decode_tokens=1, num_sampled=1, num_preempted=0, num_seqs=2,
                num_running=2, num_waiting=0, total_s=0.01, forward_s=0.008)
    acc.add(SimpleNamespace(step=1, expert_counts=torch.tensor([[3, 1], [2, 2]]), **base))
    acc.add(SimpleNamespace(step=2, expert_counts=torch.tensor([[0, 2], [1, 1]]), **base))
    assert acc.flush(1.0, {})["expert_counts"] == [[3, 3], [3, 3]]
    acc.add(SimpleNamespace(step=3, **base))  # a dense model's record: no counts
    assert "expert_counts" not in acc.flush(2.0, {})


def test_both_views_draw_it_from_a_live_moe_session():
    assert "expert_load" in CHART_NAMES and "expert_load" in FIGURES
    session = Session()
    try:
        session.load_model("tiny-mixtral", dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
        session.generate("Once upon a time", max_tokens=12, temperature=0.0, timeout=120)
        session.wait_idle(60)
        rows = session.metrics.rows(model="tiny-mixtral")
        routed = [r for r in rows if r.get("expert_counts")]
        assert routed and routed[-1]["moe_layers"] == [0, 1, 2, 3]
        stats = session.models["tiny-mixtral"].runner.moe_stats()
        assert [[sum(r["expert_counts"][i][e] for r in routed) for e in range(8)] for i in range(4)] == \
            stats["cumulative"]
        heat = ViewController(session).chart_figures()["expert_load"].data[0]
        assert heat.type == "heatmap" and sum(map(sum, heat.z)) > 0
    finally:
        session.close()
