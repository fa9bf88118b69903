"""Speculative decoding, drawn from the engine's step records (`StepMetrics.spec_decoding`: SpecDecodingStats, or
dicts with its fields), one figure for both dashboards: left, each step's draft tokens proposed and accepted (a
point for several steps in a long run: their mean), with the mean acceptance length (1 + accepted / drafts, the
tokens a verified sequence gains per step); right, the acceptance rate by draft position over the run (accepted at
position j / drafts that reached j: it falls with j, since a prefix is accepted). `draft_grid` draws a few steps
of one sequence, a row each: its drafts accepted or rolled back and the target's own token (lesson 13). Pure
functions, like workbench/views/timeline.py, whose palette they use; the step view (step_view.py) places the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.views.charts import PALETTE, TEMPLATE

TITLE = "Speculative decoding: drafts accepted"
NOTE = ("no drafts verified in the last run: turn n-gram speculation on (Speculative decoding, in the side panel) "
        "and run a workload")


def _get(stats: Any, key: str):
    return stats.get(key) if isinstance(stats, dict) else getattr(stats, key)


def run_totals(steps: Sequence[Any]) -> dict:
    """The run's drafts, draft tokens and accepted tokens in all and by position, from its steps' figures."""
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_draft_tokens_per_pos": [],
             "num_accepted_tokens_per_pos": []}
    for step in steps:
        stats = _get(step, "spec_decoding")
        if stats is None:
            continue
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total[key] += _get(stats, key)
        for key in ("num_draft_tokens_per_pos", "num_accepted_tokens_per_pos"):
            mine, theirs = total[key], _get(stats, key)
            mine += [0] * (len(theirs) - len(mine))
            for j, n in enumerate(theirs):
                mine[j] += n
    return total


def spec_decoding(steps: Sequence[Any], max_points: int = 400) -> go.Figure:
    """The figure for `steps` (a run's StepMetrics, in order): see the module's docstring."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.12,
                        subplot_titles=("draft tokens per step", "acceptance rate by draft position"))
    fig.update_layout(template=TEMPLATE, height=320, margin=dict(l=60, r=20, t=60, b=40), barmode="overlay",
                      legend=dict(orientation="h", x=0, y=-0.25), uirevision=TITLE)
    total = run_totals(steps)
    if not total["num_drafts"]:
        fig.update_layout(title=dict(text=TITLE, x=0.01, font=dict(size=14)))
        fig.add_annotation(text=NOTE, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font=dict(color=PALETTE[9]))
        return fig
    rows = [(_get(s, "step"), _get(s, "spec_decoding")) for s in steps]
    k = -(-len(rows) // max(1, max_points))
    xs, proposed, accepted = [], [], []
    for i in range(0, len(rows), k):
        group = rows[i:i + k]
        xs.append(group[-1][0])
        proposed.append(sum(_get(st, "num_draft_tokens") for _, st in group if st is not None) / len(group))
        accepted.append(sum(_get(st, "num_accepted_tokens") for _, st in group if st is not None) / len(group))
    fig.add_bar(x=xs, y=proposed, name="proposed", marker_color=PALETTE[9], opacity=0.45, row=1, col=1)
    fig.add_bar(x=xs, y=accepted, name="accepted", marker_color=PALETTE[2], row=1, col=1)
    drafted = total["num_draft_tokens_per_pos"]
    rates = [a / n if n else 0.0 for a, n in zip(total["num_accepted_tokens_per_pos"], drafted)]
    fig.add_bar(x=list(range(1, len(rates) + 1)), y=rates, name="acceptance by position", marker_color=PALETTE[0],
                customdata=drafted, hovertemplate="position %{x}: %{y:.0%} of %{customdata} drafts<extra></extra>",
                row=1, col=2)
    rate = total["num_accepted_tokens"] / total["num_draft_tokens"]
    length = 1 + total["num_accepted_tokens"] / total["num_drafts"]
    per = f" (a point per {k} steps)" if k > 1 else ""
    fig.update_layout(title=dict(text=f"{TITLE}: {rate:.0%} of {total['num_draft_tokens']} draft tokens, "
                                      f"{length:.2f} tokens per verified step{per}", x=0.01, font=dict(size=14)))
    fig.update_xaxes(title_text="engine step", row=1, col=1)
    fig.update_xaxes(title_text="draft position", dtick=1, row=1, col=2)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(range=[0, 1], tickformat=".0%", row=1, col=2)
    return fig


def draft_grid(rows: Sequence[tuple[int, int, int]], k: int) -> go.Figure:
    """Draft, verify, accept, roll back, one row a step: `rows` as (step, draft tokens verified, accepted); the
    cells of positions 1..k are the drafts (accepted, or rejected and rolled back, or not drafted), the next
    one the token the target itself gave (the bonus when every draft was accepted, else the replacement)."""
    fill = {"accepted": 3, "model": 2, "rejected": 1, "none": 0}
    scale = [[0.0, "#FFFFFF"], [0.25, "#FFFFFF"], [0.25, PALETTE[3]], [0.5, PALETTE[3]], [0.5, PALETTE[0]],
             [0.75, PALETTE[0]], [0.75, PALETTE[2]], [1.0, PALETTE[2]]]
    z, text = [], []
    for _, drafted, accepted in rows:
        kinds = (["accepted"] * accepted + ["rejected"] * (drafted - accepted) + ["model"]
                 + ["none"] * (k - drafted))
        z.append([fill[kind] for kind in kinds])
        text.append(["" if kind == "none" else kind for kind in kinds])
    fig = go.Figure(go.Heatmap(z=z, x=[f"draft {j}" for j in range(1, k + 1)] + ["+1"],
                               y=[f"step {step}" for step, _, _ in rows], text=text, texttemplate="%{text}",
                               colorscale=scale, zmin=-0.5, zmax=3.5, showscale=False, xgap=2, ygap=2,
                               hovertemplate="%{y}, %{x}: %{text}<extra></extra>"))
    gained = sum(a + 1 for _, _, a in rows)
    fig.update_layout(template=TEMPLATE, height=max(200, 28 * len(rows) + 90), margin=dict(l=70, r=20, t=50, b=30),
                      title=dict(text=f"Draft, verify, accept, roll back: {gained} tokens in {len(rows)} steps "
                                      f"(green accepted, red rolled back, blue the target's own token)",
                                 x=0.01, font=dict(size=14)),
                      yaxis=dict(autorange="reversed"))
    return fig
