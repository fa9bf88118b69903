"""Per-step views of the engine: one engine step per x position (not wall time).

`step_timeline(steps)` takes the engine's per-step records (`runner.step_metrics`: StepMetrics
objects, or dicts with the same field names) and draws, above, each step's prefill and decode
tokens stacked against the step's token budget (a long prompt cut into chunks shows as a run of
prefill bars at the budget: chunked prefill) and, below, the running requests with the step's
admissions, finishes and preemptions as markers. `step_waste(steps)` draws, for the same live
requests at each step, the KV slots the paged pool wastes against a static max_model_len reservation
and a first-fit contiguous allocator. `step_blocks(steps)` draws the pool's blocks used, cached and free
after each step, `step_times(steps)` each step's time by phase, and `step_batch(detail, before)` one
step's batch from its StepDetail (`runner.step_details`): the tokens each request ran, who was admitted,
preempted (and for whom) or finished, and the blocks allocated and freed. Pure functions, like
workbench/views/charts.py, whose palette and colours they use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.views.charts import COLORS, PALETTE, TEMPLATE, empty_blocks

FIELDS = ("step", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting",
          "num_admitted", "num_finished", "num_preempted")
BLOCK_FIELDS = ("step", "blocks_used", "blocks_cached", "blocks_free")
TIME_FIELDS = ("step", "schedule_s", "prepare_s", "forward_s", "sample_s", "observe_s")
WASTE_FIELDS = ("step", "num_running", "kv_utilization", "static_reservation_waste", "firstfit_reserved_waste",
                "firstfit_external_fragmentation")


RUN_GAP_S = 5.0  # an idle engine this long before its next step: that step starts a new run


def last_run(steps: Sequence[Any], gap_s: float = RUN_GAP_S) -> list:
    """The records of the latest run: those after the last step that left the engine idle (nothing running or
    waiting) and came `gap_s` or more before the next step. A pause mid-run does not cut it (requests still wait)."""
    start = 0
    for i in range(1, len(steps)):
        before = steps[i - 1]
        if before.num_running == 0 and before.num_waiting == 0 and steps[i].time - before.time >= gap_s:
            start = i
    return list(steps[start:])


EVENT_FIELDS = ("num_admitted", "num_finished", "num_preempted")
RATE_FIELDS = ("num_prefill_tokens", "num_decode_tokens", *TIME_FIELDS[1:])


def thin(steps: Sequence[Any], max_points: int) -> tuple[list, int]:
    """At most `max_points` rows (dicts of the step charts' fields) for a chart of `steps`, and k, the steps each
    stands for. A row for k steps has the tokens and times of a step averaged over them, the admissions, finishes
    and preemptions summed, and the state after the last of them (requests, blocks, waste)."""
    fields = dict.fromkeys((*FIELDS, *BLOCK_FIELDS, *TIME_FIELDS, *WASTE_FIELDS))
    rows = [{f: getattr(s, f, None) for f in fields} for s in steps]
    k = -(-len(rows) // max(1, max_points))
    if k <= 1:
        return rows, 1
    thinned = []
    for i in range(0, len(rows), k):
        group = rows[i:i + k]
        row = dict(group[-1])
        row.update({f: sum(r[f] for r in group) for f in EVENT_FIELDS})
        row.update({f: sum(r[f] for r in group) / len(group) for f in RATE_FIELDS})
        thinned.append(row)
    return thinned, k


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
    return go.Figure(layout=dict(title=dict(text=title, x=0.01, font=dict(size=14)), height=height, template=TEMPLATE,
                                 margin=dict(l=60, r=15, t=45, b=40),
                                 legend=dict(orientation="h", y=-0.14, x=0, traceorder="normal")))


def _no_steps(fig: go.Figure) -> go.Figure:
    fig.update_xaxes(range=[0, 1], showticklabels=False)
    fig.update_yaxes(range=[0, 1], showticklabels=False)
    fig.add_annotation(text="one point per engine step appears here: run requests (in a notebook, pass "
                            "runner.step_metrics)", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(color="#888"))
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
    for label, share, color, dash in (
            ("paged pool", lambda r: 1 - r["kv_utilization"], PALETTE[2], "solid"),
            ("static max_model_len reservation", lambda r: r["static_reservation_waste"], PALETTE[3], "solid"),
            ("first fit: reserved, not filled", lambda r: r["firstfit_reserved_waste"], PALETTE[1], "solid"),
            ("first fit: external fragmentation", lambda r: r["firstfit_external_fragmentation"], PALETTE[1], "dot")):
        fig.add_trace(go.Scatter(x=x, y=[round(100 * share(r), 2) for r in rows], name=label, mode="lines",
                                 line=dict(color=color, dash=dash, width=2),
                                 hovertemplate=f"step %{{x}}: %{{y:.1f}}% {label}<extra></extra>"))
    return fig


def step_blocks(steps: Iterable[Any], title: str = "KV blocks after each step") -> go.Figure:
    """The pool's blocks after each step, stacked to the pool's size: held by requests, free with a cached prefix,
    free and empty."""
    rows = step_rows(steps, BLOCK_FIELDS)
    fig = _figure(title, 300)
    fig.update_yaxes(title_text="blocks", rangemode="tozero")
    fig.update_xaxes(title_text="engine step")
    if not rows:
        return _no_steps(fig)
    x = [r["step"] for r in rows]
    for label, value, color in (("used", lambda r: r["blocks_used"], COLORS["kv_used"]),
                                ("cached", lambda r: r["blocks_cached"], COLORS["kv_cached"]),
                                ("free", empty_blocks, COLORS["kv_free"])):
        fig.add_trace(go.Scatter(x=x, y=[value(r) for r in rows], name=label, stackgroup="blocks", mode="lines",
                                 line=dict(width=0.5, color=color, shape="hv"), fillcolor=color,
                                 hovertemplate=f"step %{{x}}: %{{y}} blocks {label}<extra></extra>"))
    return fig


def step_times(steps: Iterable[Any], title: str = "Each step's time by phase") -> go.Figure:
    """Milliseconds per step, stacked by phase: scheduling, building inputs, the model, sampling and
    outputs, the record itself."""
    rows = step_rows(steps, TIME_FIELDS)
    fig = _figure(title, 300)
    fig.update_layout(barmode="stack", bargap=0.1)
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    fig.update_xaxes(title_text="engine step")
    if not rows:
        return _no_steps(fig)
    x = [r["step"] for r in rows]
    for k, (label, key) in enumerate((("schedule", "schedule_s"), ("inputs", "prepare_s"), ("model", "forward_s"),
                                      ("sample and outputs", "sample_s"), ("record", "observe_s"))):
        fig.add_trace(go.Bar(x=x, y=[round(1e3 * r[key], 3) for r in rows], name=label, marker_color=PALETTE[k],
                             hovertemplate=f"step %{{x}}: %{{y:.2f}} ms {label}<extra></extra>"))
    return fig


def step_batch(detail: Any | None, before: Any | None = None) -> go.Figure:
    """One step's batch from its StepDetail: a bar per request it ran (its tokens; prompt chunks and decodes
    in their colours), and in the title what else the step did: admissions, preemptions (who, for whom),
    finishes, and the blocks allocated and freed against the step `before` it."""
    fig = _figure("The batch of a step", 300)
    fig.update_xaxes(title_text="tokens run in the step", rangemode="tozero")
    fig.update_yaxes(title_text="request", autorange="reversed", type="category")
    if detail is None:
        fig.add_annotation(text="no step recorded yet: run the workload, then pick a step", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5, font=dict(color="#888"))
        return fig
    for label, prompt, color in (("prompt chunk", True, COLORS["prefill"]), ("decode", False, COLORS["decode"])):
        runs = [(rid, n) for rid, n, is_prompt in detail.scheduled if is_prompt is prompt]
        fig.add_trace(go.Bar(x=[n for _, n in runs], y=[rid for rid, _ in runs], orientation="h", name=label,
                             marker_color=color, hovertemplate=f"%{{y}}: %{{x}} tokens ({label})<extra></extra>"))
    allocated, freed = detail.blocks_changed(before)
    parts = [f"{len(detail.scheduled)} requests ran"]
    if detail.admitted:
        parts.append(f"admitted {_some(detail.admitted)}")
    if detail.preempted:
        parts.append("preempted " + _some([f"{v} (no block for {w})" for v, w in detail.preempted]))
    if detail.finished:
        parts.append(f"finished {_some(detail.finished)}")
    parts.append(f"{len(allocated)} blocks allocated, {len(freed)} freed; {len(detail.waiting)} waiting")
    fig.update_layout(title=dict(text=f"Step {detail.step}: " + "; ".join(parts)), barmode="stack",
                      height=max(300, 60 + 18 * len(detail.scheduled)))
    return fig


def _some(items: list[str], shown: int = 4) -> str:
    """The first `shown` items, and how many more."""
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")
