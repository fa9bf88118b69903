"""Pure functions from measured figures to plotly figures, for the parallelism and performance lessons.

`workbench.views.charts` draws a live session's time series; these draw one-off measurements: tokens/s
by engine (with MFU), the share of a step's time by kind of op, the communication of a parallel
step by collective, and the per-device memory of each parallel layout against a device's budget.
Inputs are plain data (lists and dicts, as the benchmarks and `runner_core` return them); every
function returns a valid figure for empty input too, with a note saying what is missing. Colours
come from the dashboards' shared palette.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from workbench.views.charts import PALETTE, TEMPLATE, empty_note

GIB = 2**30
HEIGHT = 380


def _figure(title: str, x_title: str, y_title: str, height: int = HEIGHT) -> go.Figure:
    return go.Figure(layout=dict(
        title=dict(text=title, x=0.01, font=dict(size=14)), height=height, template=TEMPLATE,
        margin=dict(l=60, r=20, t=50, b=45), legend=dict(orientation="h", y=-0.2, x=0),
        xaxis=dict(title=x_title), yaxis=dict(title=y_title)))


def engine_throughput(rows: Sequence[Mapping], title: str = "Useful tokens/s by engine") -> go.Figure:
    """Bars of tokens/s, one per engine: rows of {"engine", "tok_s"} and optionally "mfu" (a
    fraction, printed on the bar) and "note" (shown on hover, e.g. the greedy match)."""
    fig = _figure(title, "", "useful tokens/s")
    if not rows:
        return empty_note(fig, "no engine measured yet")
    labels = [f"{r['tok_s']:.3g} tok/s" + (f"<br>MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "")
              for r in rows]
    fig.add_trace(go.Bar(x=[r["engine"] for r in rows], y=[r["tok_s"] for r in rows], text=labels,
                         textposition="outside", cliponaxis=False, hovertext=[r.get("note", "") for r in rows],
                         marker_color=[PALETTE[i % len(PALETTE)] for i in range(len(rows))], showlegend=False))
    fig.update_yaxes(range=[0, 1.25 * max(r["tok_s"] for r in rows)])
    return fig


# profile_case's figures beside the shares: the step's time, the part outside the forward, per layer, the floor
NOT_SHARES = frozenset({"step_ms", "outside_forward", "layer_ms", "floor_ms", "efficiency"})


def time_by_kind(cases: Mapping[str, Mapping[str, float]], title: str = "Where a step's time goes") -> go.Figure:
    """Stacked horizontal bars: per case (e.g. "decode 1"), the share of CPU time of each kind of
    op ({case: {kind: share in 0..1}}, as `benchmarks/profile_step.profile_case` returns; its keys
    that are not shares of the op time, NOT_SHARES, are left out of the stack and the step time goes
    into the case's label)."""
    fig = _figure(title, "share of the step's CPU time (%)", "", height=max(300, 170 + 60 * len(cases)))
    if not cases:
        return empty_note(fig, "no profiled case yet")
    kinds = list(dict.fromkeys(k for shares in cases.values() for k in shares if k not in NOT_SHARES))
    labels = [f"{case} ({shares['step_ms']:.1f} ms/step)" if "step_ms" in shares else case
              for case, shares in cases.items()]
    for i, kind in enumerate(kinds):
        values = [100 * shares.get(kind, 0.0) for shares in cases.values()]
        fig.add_trace(go.Bar(name=kind, y=labels, x=values, orientation="h", marker_color=PALETTE[i % len(PALETTE)],
                             text=[f"{v:.0f}%" if v >= 6 else "" for v in values], textposition="inside",
                             hovertemplate=f"{kind}: %{{x:.1f}}%<extra></extra>"))
    fig.update_layout(barmode="stack", xaxis=dict(range=[0, 100]), yaxis=dict(autorange="reversed"),
                      legend=dict(orientation="h", y=-0.45, x=0, traceorder="normal"), margin=dict(b=110))
    return fig


def comm_per_step(layouts: Mapping[str, Mapping[str, Mapping[str, float]]],
                  title: str = "Rank 0's communication per decode step") -> go.Figure:
    """Grouped bars, one group per collective kind, one bar per layout: KiB moved per step
    ({layout: {kind: {"calls", "bytes"}}}, per step); the calls go into the bar's label."""
    fig = _figure(title, "collective", "KiB per step")
    kinds = list(dict.fromkeys(k for per_kind in layouts.values() for k, v in per_kind.items() if v.get("calls")))
    if not kinds:
        return empty_note(fig, "no communication: a one-process runner has none")
    for i, (layout, per_kind) in enumerate(layouts.items()):
        figures = [per_kind.get(k, {}) for k in kinds]
        fig.add_trace(go.Bar(name=layout, x=kinds, y=[f.get("bytes", 0) / 1024 for f in figures],
                             text=[f"{f['calls']:g} call" + ("" if f["calls"] == 1 else "s") if f.get("calls") else ""
                                   for f in figures],
                             textposition="outside",
                             cliponaxis=False, marker_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(barmode="group")
    return fig


def parallel_layouts(candidates: Sequence[Mapping], device_bytes: int, chosen: tuple | None = None,
                     title: str = "Memory per device of each parallel layout") -> go.Figure:
    """Bars of the predicted need per device of each (tp, pp) layout (`suggest_parallel_config`'s
    candidates: {"tp", "pp", "need_bytes", "fits", "why"}, and "storage" for a layout tried with a
    lighter storage format; those refused before sizing, e.g. a TP size that does not divide the
    heads, are left out) against a dashed line at the usable memory of a device; green fits, red
    does not, the chosen layout ((tp, pp), or (tp, pp, storage)) is outlined."""
    fig = _figure(title, "layout: tensor parallel x pipeline parallel (devices)", "GiB per device")
    sized = [c for c in candidates if c.get("need_bytes") is not None]
    if not sized:
        return empty_note(fig, "no layout could be sized")
    names = [f"{c['tp']}x{c['pp']} ({c['tp'] * c['pp']})" + (f" {c['storage']}" if c.get("storage") else "")
             for c in sized]
    want = None if chosen is None else (*chosen, "")[:3]  # (tp, pp, storage: "" as configured)
    picked = [(c["tp"], c["pp"], c.get("storage", "")) == want for c in sized]
    fig.add_trace(go.Bar(
        x=names, y=[c["need_bytes"] / GIB for c in sized], showlegend=False,
        marker_color=[PALETTE[2] if c["fits"] else PALETTE[3] for c in sized],
        marker_line=dict(width=[3 if p else 0 for p in picked], color="#222"),
        text=[f"{c['need_bytes'] / GIB:.0f}" + ("<br><b>chosen</b>" if p else "")
              for c, p in zip(sized, picked)], textposition="outside", cliponaxis=False,
        hovertemplate="tp x pp (devices) %{x}: %{y:.1f} GiB per device<extra></extra>"))
    top = max(max(c["need_bytes"] for c in sized), device_bytes) / GIB
    fig.update_yaxes(range=[0, 1.2 * top])
    fig.add_hline(y=device_bytes / GIB, line_dash="dash", line_color="#555",
                  annotation_text=f"usable per device: {device_bytes / GIB:.0f} GiB", annotation_position="top right")
    return fig
