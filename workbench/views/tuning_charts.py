"""Pure functions from a sweep's points to plotly figures (no session, no job, no UI state).

A point is what `TuneJob.points` and `TuneResult.points` list (runner_core/tuning/results.py): its
`settings`, `values` (the concurrency among them), `label`, `median` / `min` / `max` over its
repeats of every summary column (output_throughput, tokens_per_s_per_user, ttft_p99_ms, ...),
and `met` (its median meets the target). Every function returns a valid figure for no points too,
with a note saying what will appear; colours come from workbench/views/charts.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from runner_core.tuning.results import pareto_frontier
from workbench.views.charts import COLORS, PALETTE, base_layout, empty_note

Point = Mapping[str, Any]
THROUGHPUT, PER_USER = "output_throughput", "tokens_per_s_per_user"
PASS, FAIL, MISSED = COLORS["ok"], COLORS["failed"], PALETTE[9]  # a point missing the target is grey on the Pareto
# short names of the swept settings in point labels
SHORT = {"concurrency": "c", "max_num_seqs": "seqs", "max_num_batched_tokens": "tokens", "block_size": "block",
         "kv_cache_memory": "kv", "enable_prefix_caching": "prefix", "compile": "compile",
         "compile_mode": "mode", "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp"}
EMPTY_NOTE = "no sweep points yet: start a sweep"


def stat(point: Point, column: str, which: str = "median") -> float | None:
    return (point.get(which) or {}).get(column)


def concurrency(point: Point) -> Any:
    return (point.get("values") or {}).get("concurrency", (point.get("settings") or {}).get("concurrency"))


def short_labels(points: Sequence[Point]) -> list[str]:
    """Each point's settings that differ between the points, short ("c=8 seqs=16"), leaving out the ones a
    point does not set (it runs with the loaded value); its own label when nothing differs."""
    settings = [{"concurrency": concurrency(p), **(p.get("settings") or {})} for p in points]
    keys = [k for k in dict.fromkeys(k for s in settings for k in s)
            if len({repr(s.get(k)) for s in settings}) > 1]
    return [" ".join(f"{SHORT.get(k, k)}={s[k]}" for k in keys if s.get(k) is not None) or str(p.get("label", ""))
            for p, s in zip(points, settings)]


def hover_text(point: Point, label: str, target) -> str:
    lines = [f"<b>{label}</b>", str(point.get("label", ""))]
    for column, unit in ((THROUGHPUT, "tok/s"), (PER_USER, "tok/s per user"), (target.metric, "ms")):
        value = stat(point, column)
        if value is not None:
            lines.append(f"{column}: {value:.4g} {unit}")
    lines.append("meets the target" if point.get("met") else f"misses {target.metric} ≤ {target.limit:g}")
    return "<br>".join(lines)


def pareto(points: Sequence[Point], frontier: Sequence[Mapping] | None = None,
           recommendation: Mapping | None = None, target=None) -> go.Figure:
    """Tokens/s per user against output tokens/s of the device (vLLM's Pareto plot): the frontier's points
    labelled with the settings that differ (every point names them on hover, so many points stay readable),
    those missing the target grey crosses, the frontier (default: from the points) as a line, the
    recommended point ringed."""
    fig = go.Figure(layout=base_layout("Pareto: per-user speed against device throughput", "tokens/s per user"))
    fig.update_xaxes(title_text="output tokens/s (device)")
    scored = [p for p in points if stat(p, THROUGHPUT) is not None and stat(p, PER_USER) is not None]
    if not scored:
        return empty_note(fig, EMPTY_NOTE)
    labels = dict(zip(map(id, scored), short_labels(scored)))
    line = sorted(frontier if frontier is not None else pareto_frontier(list(scored)), key=lambda f: f[THROUGHPUT])
    on_line = {(f[THROUGHPUT], f[PER_USER]) for f in line}
    shown = {id(p): labels[id(p)] if (stat(p, THROUGHPUT), stat(p, PER_USER)) in on_line else "" for p in scored}
    for name, met, color, symbol in (("meets the target", True, PASS, "circle"),
                                     ("misses the target", False, MISSED, "x")):
        group = [p for p in scored if bool(p.get("met")) is met]
        if group:
            fig.add_trace(go.Scatter(
                x=[stat(p, THROUGHPUT) for p in group], y=[stat(p, PER_USER) for p in group], name=name,
                mode="markers+text", text=[shown[id(p)] for p in group], textposition="top center",
                textfont=dict(size=10), marker=dict(color=color, size=10, symbol=symbol),
                hovertext=[hover_text(p, labels[id(p)], target) if target else labels[id(p)] for p in group],
                hoverinfo="text"))
    if line:
        fig.add_trace(go.Scatter(x=[f[THROUGHPUT] for f in line], y=[f[PER_USER] for f in line],
                                 name="Pareto frontier", mode="lines", line=dict(color=PALETTE[0], dash="dot"),
                                 hoverinfo="skip"))
    best = next((p for p in scored if recommendation and p.get("settings") == recommendation.get("settings")), None)
    if best is not None:
        fig.add_trace(go.Scatter(x=[stat(best, THROUGHPUT)], y=[stat(best, PER_USER)],
                                 name=f"recommended: {labels[id(best)]}", mode="markers", hoverinfo="skip",
                                 marker=dict(size=22, symbol="circle-open", color=PALETTE[3], line=dict(width=3))))
    return fig


def _range_bars(points: Sequence[Point], column: str) -> dict:
    med = [stat(p, column) for p in points]
    return dict(type="data", symmetric=False,
                array=[(stat(p, column, "max") or m) - m for p, m in zip(points, med)],
                arrayminus=[m - (stat(p, column, "min") or m) for p, m in zip(points, med)])


def latency_vs_concurrency(points: Sequence[Point], target) -> go.Figure:
    """TTFT p99 and TPOT p99 (ms) against concurrency, the median of each point with its repeats'
    [min, max] as a range bar; the target's limit a dashed line on the panel of the metric it constrains."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT p99 (ms)", "TPOT p99 (ms)"), horizontal_spacing=0.12)
    layout = base_layout("Latency against concurrency", "")
    for key in ("xaxis", "yaxis", "uirevision"):
        layout.pop(key)
    fig.update_layout(**layout, uirevision="latency")
    fig.update_xaxes(title_text="concurrency (requests in flight)", rangemode="tozero")
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    shown = sorted((p for p in points if concurrency(p) is not None), key=concurrency)
    if not shown:
        return empty_note(fig, EMPTY_NOTE)
    labels = short_labels(shown)
    fig.update_xaxes(tickmode="array", tickvals=sorted({concurrency(p) for p in shown}))  # the levels measured
    for col, (column, color) in enumerate((("ttft_p99_ms", COLORS["prefill"]), ("tpot_p99_ms", COLORS["decode"])), 1):
        kept = [(p, lab) for p, lab in zip(shown, labels) if stat(p, column) is not None]
        if not kept:
            continue
        one_per_c = len({concurrency(p) for p, _ in kept}) == len(kept)
        fig.add_trace(go.Scatter(
            x=[concurrency(p) for p, _ in kept], y=[stat(p, column) for p, _ in kept], name=column,
            mode="lines+markers" if one_per_c else "markers", marker=dict(color=color, size=8),
            line=dict(color=color), error_y=_range_bars([p for p, _ in kept], column), text=[lab for _, lab in kept],
            hovertemplate=f"%{{text}}: {column} %{{y:.1f}} ms<extra></extra>"), row=1, col=col)
    panel = {"ttft": 1, "tpot": 2}.get(target.metric.split("_")[0])
    if panel is not None:
        fig.add_hline(y=target.limit, row=1, col=panel, line=dict(color=FAIL, dash="dash"),
                      annotation_text=f"target: {target.metric} ≤ {target.limit:g}", annotation_position="top left")
    return fig


def pass_fail(points: Sequence[Point], target) -> go.Figure:
    """Each point's target metric (median, [min, max] over repeats) against the limit: green bars pass,
    red ones fail; the title counts them."""
    fig = go.Figure(layout=base_layout(f"Target: {target.metric} ≤ {target.limit:g}", target.metric))
    fig.update_xaxes(title_text="point (the settings that differ)", rangemode="normal")
    shown = [p for p in points if stat(p, target.metric) is not None]
    if not shown:
        return empty_note(fig, EMPTY_NOTE)
    labels = short_labels(shown)
    passed = sum(bool(p.get("met")) for p in shown)
    fig.add_trace(go.Bar(x=labels, y=[stat(p, target.metric) for p in shown], showlegend=False,
                         marker_color=[PASS if p.get("met") else FAIL for p in shown],
                         error_y=_range_bars(shown, target.metric),
                         hovertemplate=f"%{{x}}: {target.metric} %{{y:.1f}}<extra></extra>"))
    fig.add_hline(y=target.limit, line=dict(color=PALETTE[9], dash="dash"), annotation_text=f"limit {target.limit:g}")
    fig.update_layout(title_text=f"Target {target.metric} ≤ {target.limit:g}: {passed} of {len(shown)} points pass")
    return fig


def progress_fraction(progress, repeats: int) -> float:
    """How far a sweep is, 0 to 1, from its latest TuneProgress (None: not started): repeats measured
    over the repeats planned."""
    if progress is None or not progress.points_total:
        return 0.0
    done = progress.point_index * repeats + progress.repeat + 1
    return min(1.0, done / (progress.points_total * repeats))


def recommendation_text(result, target) -> str:
    """The recommendation of a finished sweep (a TuneResult) in a line or two of Markdown."""
    rec = None if result is None else result.recommendation
    if rec is None:
        return f"**No recommendation**: {getattr(result, 'why', 'the sweep measured no point')}"
    verdict = "meets" if rec.get("met", True) else "misses"
    text = (f"**Recommended: {rec['label']}** — {rec['throughput']:.1f} output tokens/s, {target.metric} "
            f"{rec['value']:.1f} ({verdict} ≤ {target.limit:g}, margin {rec['margin']:.0%})")
    ties = [" ".join(f"{k}={v}" for k, v in t.items() if rec["settings"].get(k) != v) for t in rec.get("ties") or []]
    if ties:
        text += f"; within noise of it: {'; '.join(ties)}"
    return text


def all_figures(points: Sequence[Point], target, result=None) -> dict[str, go.Figure]:
    """The Tuning tab's charts by name; a finished sweep's `result` adds its frontier and recommendation."""
    frontier = None if result is None else result.frontier
    rec = None if result is None else result.recommendation
    return {"pareto": pareto(points, frontier, rec, target), "latency": latency_vs_concurrency(points, target),
            "pass_fail": pass_fail(points, target)}
