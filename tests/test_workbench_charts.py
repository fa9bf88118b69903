"""workbench.charts: valid plotly figures from empty and from full histories (pure functions)."""

from __future__ import annotations

import json

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from workbench import charts
from workbench.metrics import MetricsSeries, StepAccumulator


def _full_rows(n: int = 3000) -> list[dict]:
    rows = []
    for i in range(n):
        used = (i * 7) % 200
        rows.append({
            "t": i * 0.1, "dt": 0.1, "model": "m", "steps": 5, "prefill_tokens": (i % 3) * 100,
            "decode_tokens": 40, "sampled_tokens": 40, "preempted": i % 50 == 0, "num_seqs": 8, "num_running": 8,
            "num_waiting": 2, "tokens_per_s": 400.0, "step_ms": 20.0, "forward_ms": 15.0,
            "weights_bytes": 3_478_016, "kv_pool_bytes": 16 << 20, "blocks_total": 512, "blocks_used": used,
            "blocks_cached": 10, "blocks_free": 512 - used - 10, "block_size": 16, "kv_utilization": 0.9,
            "internal_fragmentation": 0.1, "static_reservation_waste": 0.85, "prefix_cache_hit_rate": 0.0,
            "activation_peak_bytes": 1 << 20,
        })
    return rows


def _valid(fig: go.Figure) -> dict:
    assert isinstance(fig, go.Figure)
    go.Figure(fig.to_dict())  # re-validates every property
    spec = json.loads(pio.to_json(fig))
    assert "data" in spec and "layout" in spec
    return spec


EMPTY_BLOCK_MAP = {"num_blocks": 0, "owners": {}}


@pytest.mark.parametrize("name", ["memory", "blocks", "waste", "throughput", "block_map", "compile"])
def test_empty_history_gives_a_valid_figure_with_a_note(name):
    fig = charts.all_figures([], [], None)[name]
    spec = _valid(fig)
    assert spec["data"] == [] and spec["layout"]["annotations"], "an empty chart says what will appear"
    assert _valid(charts.all_figures([], [], EMPTY_BLOCK_MAP)[name])


def test_full_history_figures():
    rows = _full_rows()
    events = [{"kind": "load", "t": 0.0}, {"kind": "compile", "t": 1.0, "enabled": True, "backend": "inductor",
                                           "mode": "default", "seconds": 12.5, "ok": True,
                                           "stats": {"compile_seconds_per_size": {"1": 2.0, "8": 3.5},
                                                     "decode_programs": {"build_seconds": {"4": 1.5, "1": 0.5}}}},
              {"kind": "compile", "t": 2.0, "enabled": False, "seconds": 0.1, "ok": True},
              {"kind": "compile", "t": 3.0, "enabled": True, "backend": "bogus", "seconds": 0.0, "ok": False,
               "error": "unknown backend"}]
    owners = {f"wb-{i}": list(range(i * 6, i * 6 + 5)) for i in range(30)}
    snapshot = {"num_blocks": 512, "block_size": 16, "owners": owners, "cached_block_ids": [500, 501]}
    figs = charts.all_figures(rows, events, snapshot)
    for fig in figs.values():
        _valid(fig)

    mem = figs["memory"]
    assert [t.name for t in mem.data] == ["weights", "activations (peak)", "KV in use", "KV cached", "KV free"]
    assert all(len(t.x) == len(rows) for t in mem.data)
    top = sum(t.y[-1] for t in mem.data if t.name.startswith("KV"))
    assert top == pytest.approx(16.0)  # the KV bands add up to the pool (MiB)
    assert [t.name for t in figs["blocks"].data] == ["used", "cached", "free"]
    waste = figs["waste"]
    assert waste.data[0].y[-1] == pytest.approx(85.0) and waste.data[1].y[-1] == pytest.approx(10.0)
    thr = figs["throughput"]
    assert thr.data[1].y[0] == pytest.approx(8.0)  # 40 decode tokens over 5 steps
    assert thr.data[2].y[-1] == pytest.approx(400.0)  # 40 tokens per 0.1 s
    bars = figs["compile"].data
    assert list(bars[0].x) == ["#1 inductor/default", "#2 eager", "#3 bogus"]
    assert list(bars[1].y) == [2.0, 3.5]
    assert (list(bars[2].x), list(bars[2].y)) == (["decode 1", "decode 4"], [0.5, 1.5])

    heat = figs["block_map"].data[0]
    z = [v for row in heat.z for v in row]
    assert len(z) == 512
    assert z[0] != 0 and z[5] == 0 and z[500] == 1  # owned, free, cached
    assert z[0] != z[6]  # two requests, two colours
    assert "30 requests hold 150 of 512 blocks" in figs["block_map"].layout.title.text
    assert "wb-0" in heat.hovertext[0][0]


def test_block_map_of_a_huge_pool_shows_its_low_end():
    snap = {"num_blocks": 65536, "owners": {"a": [0, 1, 2], "b": [700]}}
    fig = charts.kv_block_map(snap, columns=64, max_blocks=4096)
    heat = fig.data[0]
    assert len(heat.z) * 64 <= 4096 and len(heat.z) * 64 > 700
    assert "first" in fig.layout.title.text


def test_rolling_rate_averages_busy_time():
    rows = [{"t": 0.0, "dt": 0.1, "n": 10}, {"t": 0.1, "dt": 0.1, "n": 30}, {"t": 5.0, "dt": 0.05, "n": 5}]
    assert charts.rolling_rate(rows, "n", window=1.0) == pytest.approx([100.0, 200.0, 100.0])


def test_accumulator_folds_steps_into_rows():
    class M:  # a StepMetrics stand-in
        def __init__(self, step):
            self.step, self.num_prefill_tokens, self.num_decode_tokens, self.num_sampled = step, 16, 4, 5
            self.num_preempted, self.num_seqs, self.num_running, self.num_waiting = 0, 5, 5, 1
            self.total_s, self.forward_s = 0.01, 0.008

    acc = StepAccumulator("m", t0=0.0)
    for step in (1, 2, 2, 3):  # a repeated record is counted once
        acc.add(M(step))
    row = acc.flush(acc.start + 0.5, {"blocks_used": 3, "unrelated": 1})
    assert row["steps"] == 3 and row["prefill_tokens"] == 48 and row["tokens_per_s"] == pytest.approx(30.0)
    assert row["blocks_used"] == 3 and "unrelated" not in row and row["step_ms"] == pytest.approx(10.0)
    series = MetricsSeries(maxlen=2)
    for i in range(5):
        series.append({"t": i, "model": "a" if i % 2 else "b"})
    assert len(series) == 2 and [r["t"] for r in series.rows()] == [3, 4]
    assert series.poll(3) == (series.rows(), 5) and series.rows(model="a") == [{"t": 3, "model": "a"}]
