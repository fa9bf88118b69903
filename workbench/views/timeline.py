"""Per-step views of the engine: one engine step per x position (not wall time).

`step_timeline(steps)` takes the engine's per-step records (`runner.step_metrics`: StepMetrics
objects, or dicts with the same field names) and draws, above, each step's prefill and decode
tokens stacked against the step's token budget (a long prompt cut into chunks shows as a run of
prefill bars at the budget: chunked prefill) and, below, the running requests with the step's
admissions, finishes and preemptions as markers. `step_waste(steps)` draws, for the same live
requests at each step, the KV slots the paged pool wastes against a static max_model_len reservation
and a first-fit contiguous allocator. Pure functions, like workbench/views/charts.py, whose palette they use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.views.charts import PALETTE

FIELDS = ("step", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting",
          "num_admitted", "num_finished", "num_preempted")
WASTE_FIELDS = ("step", "num_running", "kv_utilization", "static_reservation_waste", "firstfit_reserved_waste",
                "firstfit_external_fragmentation")


def step_rows(steps: Iterable[Any], fields: tuple[str, ...] = FIELDS) -> list[dict]:
    """Plain dicts of `fields` from StepMetrics records or mappings (a missing field is named,
    with where the records come from)."""
    rows = []
    for s in steps:
        get = s.get if isinstance(s, Mapping) else lambda k, s=s: getattr(s, k, None)
        row = {k: get(k) for k in fields}
        missing = [k for k, v in row.items() if v is None]
        if missing:
            waste = set(missing) & set(WASTE_FIELDS)
            raise ValueError(f"step record has no {', '.join(missing)}; " + (
                "the KV waste figures are recorded per step only after runner.record_waste_per_step()"
                if waste else f"pass runner.step_metrics records (StepMetrics) or dicts with the fields "
                              f"{', '.join(fields)}"))
        rows.append(row)
    return rows


def _figure(title: str, height: int) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=14)), height=height, template="plotly_white",
                      margin=dict(l=60, r=15, t=45, b=40),
                      legend=dict(orientation="h", y=-0.14, x=0, traceorder="normal"))
    return fig


def _no_steps(fig: go.Figure) -> go.Figure:
    fig.add_annotation(text="no steps yet: run requests, then pass runner.step_metrics", showarrow=False,
                       xref="paper", yref="paper", x=0.5, y=0.5, font=dict(color="#888"))
    return fig


def step_timeline(steps: Iterable[Any], max_num_batched_tokens: int | None = None,
                  title: str = "Continuous batching, step by step") -> go.Figure:
    """Tokens per step (prefill and decode, stacked; the budget as a dashed line when given) over
    the requests running, admitted, finished and preempted at each step."""
    rows = step_rows(steps)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.58, 0.42],
                        figure=_figure(title, 460))
    fig.update_layout(barmode="stack", bargap=0.15)
    fig.update_yaxes(title_text="tokens in the step", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="engine step", row=2, col=1)
    if not rows:
        return _no_steps(fig)
    x = [r["step"] for r in rows]

    def col(key: str) -> list:
        return [r[key] for r in rows]

    fig.add_trace(go.Bar(x=x, y=col("num_prefill_tokens"), name="prefill tokens", marker_color=PALETTE[0]),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=col("num_decode_tokens"), name="decode tokens", marker_color=PALETTE[1]),
                  row=1, col=1)
    if max_num_batched_tokens:
        fig.add_trace(go.Scatter(x=[x[0] - 0.5, x[-1] + 0.5], y=[max_num_batched_tokens] * 2, mode="lines",
                                 name=f"token budget ({max_num_batched_tokens})",
                                 line=dict(color="#777", dash="dash", width=1)), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=col("num_running"), name="running", mode="lines", line_shape="hv",
                             line=dict(color=PALETTE[2], width=2)), row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=col("num_waiting"), name="waiting", mode="lines", line_shape="hv",
                             line=dict(color=PALETTE[9], width=1, dash="dot")), row=2, col=1)
    for key, label, color, symbol in (("num_admitted", "admitted", PALETTE[4], "triangle-up"),
                                      ("num_finished", "finished", PALETTE[5], "square"),
                                      ("num_preempted", "preempted", PALETTE[3], "x")):
        events = [(s, r[key]) for s, r in zip(x, rows) if r[key]]
        fig.add_trace(go.Scatter(x=[s for s, _ in events], y=[n for _, n in events], name=label, mode="markers",
                                 marker=dict(color=color, symbol=symbol, size=9, line=dict(width=1, color="white")),
                                 hovertemplate=f"step %{{x}}: %{{y}} {label}<extra></extra>"), row=2, col=1)
    return fig


def step_waste(steps: Iterable[Any], title: str = "KV slots wasted, step by step") -> go.Figure:
    """For the requests running at each step, the share of the KV slots they hold (paged) or would
    reserve (contiguous) that holds no token: the paged pool (empty tails of last blocks), a static
    max_model_len reservation per request and a first-fit worst-case reservation, and first fit's
    external fragmentation (free slots outside its largest hole). Steps with no running request
    are left out."""
    rows = [r for r in step_rows(steps, WASTE_FIELDS) if r["num_running"]]
    fig = _figure(title, 360)
    fig.update_layout(legend_y=-0.25)
    fig.update_yaxes(title_text="% of slots", range=[0, 100])
    fig.update_xaxes(title_text="engine step")
    if not rows:
        return _no_steps(fig)
    x = [r["step"] for r in rows]
    for label, y, color, dash in (
            ("paged pool", [100 * (1 - r["kv_utilization"]) for r in rows], PALETTE[2], "solid"),
            ("static max_model_len reservation", [100 * r["static_reservation_waste"] for r in rows], PALETTE[3],
             "solid"),
            ("first fit: reserved, not filled", [100 * r["firstfit_reserved_waste"] for r in rows], PALETTE[1],
             "solid"),
            ("first fit: external fragmentation", [100 * r["firstfit_external_fragmentation"] for r in rows],
             PALETTE[1], "dot")):
        fig.add_trace(go.Scatter(x=x, y=y, name=label, mode="lines", line=dict(color=color, dash=dash, width=2),
                                 hovertemplate=f"step %{{x}}: %{{y:.1f}}% {label}<extra></extra>"))
    return fig
