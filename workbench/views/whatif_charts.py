"""Pure functions from a what-if's data to plotly figures (no session, no job, no UI state).

Points are what `WhatifJob.points` and a what-if's TuneResult list (the tuning sweep's points, see
workbench/views/tuning_charts.py), a simulated one with "band_low" / "band_high": its output tokens/s at the
pessimistic and optimistic ends of the device's efficiency band. A layout's memory is a dict with the keys of
a runner's memory_stats(): weights_bytes, kv_pool_bytes, activation_peak_bytes, plus reserved_bytes (held
outside the model), device_memory_bytes (per device), usable_bytes (what the model may use: device memory x
gpu_memory_utilization), label, fits and why (workbench.whatif.job.memory_layouts builds them). Every
function returns a valid figure for no data too, with a note saying what will appear.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.views.charts import COLORS, PALETTE, base_layout, empty_note
from workbench.views.tuning_charts import PER_USER, THROUGHPUT, hover_text, latency_vs_concurrency, short_labels, stat

Point = Mapping[str, Any]
GIB = 2**30
WARNING = COLORS["failed"]
MEASURED_COLOR = PALETTE[9]
SIMULATED_COLORS = (PALETTE[0], PALETTE[1], PALETTE[2], PALETTE[4], PALETTE[5], PALETTE[7])
# the memory picture's parts, bottom to top: (key, legend name, colour)
MEMORY_PARTS = (("weights_bytes", "weights", COLORS["weights"]), ("kv_pool_bytes", "KV pool", COLORS["kv_used"]),
                ("activation_peak_bytes", "activation peak", COLORS["activations"]),
                ("reserved_bytes", "reserved (runtime, workspaces)", PALETTE[9]))
EMPTY_NOTE = "no points yet: press Simulate"
MEMORY_NOTE = "no layouts yet: press Memory picture"


def device_label(point: Point) -> str:
    """ "simulated h100-sxm x8": the point's hardware and its device count (tensor x pipeline parallel)."""
    values = {**(point.get("values") or {}), **(point.get("settings") or {})}
    devices = int(values.get("tensor_parallel_size") or 1) * int(values.get("pipeline_parallel_size") or 1)
    return f"simulated {values.get('hardware') or 'cpu'} x{devices}"


def pareto(simulated: Sequence[Point], measured: Sequence[Point] = (), *, target,
           measured_label: str = "measured on this CPU") -> go.Figure:
    """Tokens/s per user against output tokens/s: simulated points as diamonds, one colour per device and
    count, with the efficiency band's output tokens/s as a horizontal error bar; measured points (a real
    sweep) as grey circles next to them. A point missing the target is drawn open."""
    fig = go.Figure(layout=base_layout("What-if: per-user speed against throughput", "tokens/s per user",
                                   showlegend=True))
    fig.update_xaxes(title_text="output tokens/s (all devices)")
    scored = [p for p in simulated if stat(p, THROUGHPUT) is not None and stat(p, PER_USER) is not None]
    real = [p for p in measured if stat(p, THROUGHPUT) is not None and stat(p, PER_USER) is not None]
    if not scored and not real:
        return empty_note(fig, EMPTY_NOTE)
    groups: dict[str, list[Point]] = {}
    for p in scored:
        groups.setdefault(device_label(p), []).append(p)
    for i, (name, group) in enumerate(groups.items()):
        _points(fig, group, name, SIMULATED_COLORS[i % len(SIMULATED_COLORS)], "diamond", target, band=True)
    if real:
        _points(fig, real, measured_label, MEASURED_COLOR, "circle", target, band=False)
    return fig


def _points(fig: go.Figure, points: Sequence[Point], name: str, color: str, symbol: str, target,
            band: bool) -> None:
    labels = short_labels(points)
    x = [stat(p, THROUGHPUT) for p in points]
    error_x = None
    if band and any(p.get("band_low") is not None for p in points):
        error_x = dict(type="data", symmetric=False, color=color,
                       array=[max(0.0, (p.get("band_high") or v) - v) for p, v in zip(points, x)],
                       arrayminus=[max(0.0, v - (p.get("band_low") or v)) for p, v in zip(points, x)])
    fig.add_trace(go.Scatter(
        x=x, y=[stat(p, PER_USER) for p in points], name=name, mode="markers", error_x=error_x,
        marker=dict(color=color, size=11, line=dict(color=color, width=2),
                    symbol=[symbol if p.get("met") else f"{symbol}-open" for p in points]),
        hovertext=[hover_text(p, label, target) + _band_line(p) for p, label in zip(points, labels)], hoverinfo="text"))


def _band_line(point: Point) -> str:
    if point.get("band_low") is None:
        return ""
    return f"<br>band: {point['band_low']:.4g} .. {point['band_high']:.4g} tok/s"


def memory_picture(layouts: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Per device of each layout, stacked GiB of weights / KV pool / activation peak / reserved against the
    device's memory (a black tick) and what the model may use of it (a dashed tick). A layout that does not
    fit is outlined in the warning colour, over its line, with what it needs written above it (and why, on
    hover)."""
    fig = go.Figure(layout=base_layout("Memory per device", "GiB", barmode="stack"))
    fig.update_xaxes(title_text="layout", type="category")
    if not layouts:
        return empty_note(fig, MEMORY_NOTE)
    labels = [m["label"] for m in layouts]
    for key, name, color in MEMORY_PARTS:
        fig.add_trace(go.Bar(x=labels, y=[m.get(key, 0) / GIB for m in layouts], name=name, marker_color=color,
                             hovertemplate=f"%{{x}}: {name} %{{y:.1f}} GiB<extra></extra>"))
    for lines, (key, name, dash) in enumerate((("device_memory_bytes", "device memory", "solid"),
                                              ("usable_bytes", "usable (gpu_memory_utilization)", "dash"))):
        xs, ys = [], []
        for i, m in enumerate(layouts):  # one tick across each bar, at its own device's figure
            xs += [i - 0.45, i + 0.45, None]
            ys += [m[key] / GIB] * 2 + [None]
        fig.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="lines", xaxis="x2", hoverinfo="skip",
                                 line=dict(color="#222222" if not lines else PALETTE[9], dash=dash, width=2)))
    fig.update_layout(xaxis2=dict(overlaying="x", range=[-0.5, len(layouts) - 0.5], visible=False))
    for i, m in enumerate(layouts):
        total = sum(m.get(key, 0) for key, _, _ in MEMORY_PARTS)
        if not m["fits"]:  # the whole bar outlined in the warning colour
            fig.add_shape(type="rect", xref="x2", x0=i - 0.4, x1=i + 0.4, y0=0, y1=total / GIB,
                          line=dict(color=WARNING, width=3))
        text = "fits" if m["fits"] else f"does not fit: needs {total / GIB:.0f} of {m['usable_bytes'] / GIB:.0f} GiB"
        fig.add_annotation(x=m["label"], y=max(total, m["device_memory_bytes"]) / GIB, text=text, showarrow=False,
                           yanchor="bottom",
                           font=dict(color=WARNING if not m["fits"] else PALETTE[2], size=11),
                           hovertext=m.get("why") or None)
    return fig


def all_figures(simulated: Sequence[Point], target, *, measured: Sequence[Point] = (),
                measured_label: str = "measured on this CPU") -> dict[str, go.Figure]:
    """The What-if tab's point charts by name: the Pareto of simulated (and measured) points and the
    simulated latencies against concurrency (the memory picture is drawn on its own, without a run)."""
    return {"pareto": pareto(simulated, measured, target=target, measured_label=measured_label),
            "latency": latency_vs_concurrency(simulated, target)}
