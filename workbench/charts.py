"""Pure functions from session metrics to plotly figures (no session, no engine, no UI state).

Inputs are plain data: `rows` (dicts from `MetricsSeries`, see workbench/metrics.py), `events`
(dicts with `kind`, `t`, ...) and a KV block-map snapshot ({"num_blocks", "owners":
{request_id: [block ids]}, ...}). Every function returns a valid `go.Figure` for empty input
too, with a note saying what will appear.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

MIB = 2**20
HEIGHT = 290
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D",
           "#EECA3B", "#79706E")
FREE_COLOR, CACHED_COLOR = "#ECEFF3", "#A9B4C2"

Rows = Sequence[Mapping[str, Any]]


def _layout(title: str, y_title: str = "", **extra) -> dict:
    return dict(
        title=dict(text=title, x=0.01, font=dict(size=14)), height=HEIGHT, template="plotly_white",
        margin=dict(l=55, r=15, t=40, b=35), legend=dict(orientation="h", y=-0.22, x=0),
        xaxis=dict(title="time (s)"), yaxis=dict(title=y_title, rangemode="tozero"),
        uirevision=title,  # keep the user's zoom across live updates
        **extra)


def _empty(fig: go.Figure, note: str) -> go.Figure:
    fig.add_annotation(text=note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(color="#888"))
    return fig


def _col(rows: Rows, key: str, scale: float = 1.0) -> list:
    return [None if r.get(key) is None else r[key] * scale for r in rows]


def memory_breakdown(rows: Rows) -> go.Figure:
    """Stacked memory of the model over time (MiB): weights, KV pool split into blocks in use,
    cached (reusable prefix blocks) and free, plus the activation peak when the runner reports it."""
    fig = go.Figure(layout=_layout("Memory breakdown", "MiB"))
    rows = [r for r in rows if r.get("kv_pool_bytes") is not None]
    if not rows:
        return _empty(fig, "no data yet: load a model")
    t = _col(rows, "t")
    per_block = [r["kv_pool_bytes"] / r["blocks_total"] if r.get("blocks_total") else 0 for r in rows]
    series = [("weights", _col(rows, "weights_bytes", 1 / MIB), PALETTE[0])]
    act_key = next((k for k in ("activation_peak_bytes", "activations_peak_bytes") if rows[-1].get(k)), None)
    if act_key:
        series.append(("activations (peak)", _col(rows, act_key, 1 / MIB), PALETTE[5]))
    for label, key, color in (("KV in use", "blocks_used", PALETTE[1]), ("KV cached", "blocks_cached", PALETTE[4]),
                              ("KV free", "blocks_free", "#C9D3DD")):
        series.append((label, [r.get(key, 0) * b / MIB for r, b in zip(rows, per_block)], color))
    for label, y, color in series:
        fig.add_trace(go.Scatter(x=t, y=y, name=label, stackgroup="mem", mode="lines",
                                 line=dict(width=0.5, color=color)))
    return fig


def kv_blocks(rows: Rows) -> go.Figure:
    """KV pool blocks used / cached / free over time."""
    fig = go.Figure(layout=_layout("KV cache blocks", "blocks"))
    rows = [r for r in rows if r.get("blocks_total") is not None]
    if not rows:
        return _empty(fig, "no data yet: load a model")
    t = _col(rows, "t")
    for label, key, color in (("used", "blocks_used", PALETTE[1]), ("cached", "blocks_cached", PALETTE[4]),
                              ("free", "blocks_free", "#C9D3DD")):
        fig.add_trace(go.Scatter(x=t, y=_col(rows, key), name=label, stackgroup="blocks", mode="lines",
                                 line=dict(width=0.5, color=color)))
    return fig


def waste(rows: Rows) -> go.Figure:
    """Wasted KV slots (%): the paged pool (unused slots in partly filled blocks) against a
    contiguous per-request max_model_len reservation of the same requests (a static cache)."""
    fig = go.Figure(layout=_layout("KV waste: paged vs contiguous reservation", "% of reserved slots"))
    rows = [r for r in rows if r.get("internal_fragmentation") is not None]
    if not rows:
        return _empty(fig, "no data yet: generate something")
    t = _col(rows, "t")
    fig.add_trace(go.Scatter(x=t, y=_col(rows, "static_reservation_waste", 100), name="contiguous reservation",
                             mode="lines+markers", marker=dict(size=4), line=dict(color=PALETTE[3])))
    fig.add_trace(go.Scatter(x=t, y=_col(rows, "internal_fragmentation", 100), name="paged (internal fragmentation)",
                             mode="lines+markers", marker=dict(size=4), line=dict(color=PALETTE[2])))
    fig.update_yaxes(range=[0, 100])
    return fig


def throughput(rows: Rows, window: float = 1.0) -> go.Figure:
    """Batch composition (prefill vs decode tokens per step, stacked) and generated tokens/s
    (right axis) averaged over the busy time of the last `window` seconds."""
    fig = go.Figure(layout=_layout("Throughput and batch composition", "tokens per step",
                                   yaxis2=dict(title="generated tokens/s", overlaying="y", side="right",
                                               rangemode="tozero", showgrid=False)))
    rows = [r for r in rows if r.get("steps")]
    if not rows:
        return _empty(fig, "no steps yet: generate something")
    rates = rolling_rate(rows, "sampled_tokens", window)
    t, prefill, decode, rate = [], [], [], []
    for i, (r, rt) in enumerate(zip(rows, rates)):
        if i and r["t"] - rows[i - 1]["t"] > 5 * max(r.get("dt", 0.1), 0.1):  # idle gap: drop to zero
            t += [rows[i - 1]["t"] + 0.01, r["t"] - r.get("dt", 0.1)]
            prefill += [0, 0]
            decode += [0, 0]
            rate += [0, 0]
        t.append(r["t"])
        prefill.append(r["prefill_tokens"] / r["steps"])
        decode.append(r["decode_tokens"] / r["steps"])
        rate.append(rt)
    fig.add_trace(go.Scatter(x=t, y=prefill, name="prefill tokens/step", stackgroup="batch", mode="lines",
                             line=dict(width=0.5, color=PALETTE[0])))
    fig.add_trace(go.Scatter(x=t, y=decode, name="decode tokens/step", stackgroup="batch", mode="lines",
                             line=dict(width=0.5, color=PALETTE[1])))
    fig.add_trace(go.Scatter(x=t, y=rate, name="generated tokens/s", yaxis="y2", mode="lines",
                             line=dict(color=PALETTE[3])))
    return fig


def rolling_rate(rows: Rows, key: str, window: float = 1.0) -> list[float]:
    """`key` per busy second over the rows of the last `window` seconds (rows carry `dt`)."""
    out, lo, total, busy = [], 0, 0.0, 0.0
    for hi, row in enumerate(rows):
        total += row.get(key, 0)
        busy += row.get("dt", 0.0)
        while lo < hi and row["t"] - rows[lo]["t"] >= window:
            total -= rows[lo].get(key, 0)
            busy -= rows[lo].get("dt", 0.0)
            lo += 1
        out.append(total / busy if busy > 1e-9 else 0.0)
    return out


def kv_block_map(snapshot: Mapping[str, Any] | None, columns: int = 64, max_blocks: int = 4096) -> go.Figure:
    """Which request owns which KV block, one cell per block (a colour per request; cached
    prefix blocks grey when the snapshot names them). Pools larger than `max_blocks` show
    the low end, where the allocator places blocks first."""
    fig = go.Figure(layout=_layout("KV block map (who owns which block)", ""))
    fig.update_layout(xaxis=dict(title="", showticklabels=False, showgrid=False, zeroline=False),
                      yaxis=dict(title="block row", autorange="reversed", showgrid=False, zeroline=False,
                                 rangemode="normal"), showlegend=False)
    if not snapshot or not snapshot.get("num_blocks"):
        return _empty(fig, "no data yet: load a model")
    total = int(snapshot["num_blocks"])
    owners: Mapping[str, Sequence[int]] = snapshot.get("owners", {})
    cached = set(snapshot.get("cached_block_ids", ()))
    top = max([b for blocks in owners.values() for b in blocks] + list(cached) + [-1]) + 1
    shown = total if total <= max_blocks else min(max_blocks, max(columns * 8, math.ceil(top / columns) * columns))
    n_rows = math.ceil(shown / columns)
    z = [[0] * columns for _ in range(n_rows)]
    text = [[f"block {r * columns + c}: free" if r * columns + c < total else "" for c in range(columns)]
            for r in range(n_rows)]
    for b in cached:
        if b < shown:
            z[b // columns][b % columns] = 1
            text[b // columns][b % columns] = f"block {b}: cached prefix"
    for i, (rid, blocks) in enumerate(sorted(owners.items(), key=lambda kv: _natural(kv[0]))):
        for b in blocks:
            if b < shown:
                z[b // columns][b % columns] = 2 + i % len(PALETTE)
                text[b // columns][b % columns] = f"block {b}: {rid}"
    for c in range(shown, n_rows * columns):  # cells past the end of the pool
        z[c // columns][c % columns] = None
    steps = [FREE_COLOR, CACHED_COLOR, *PALETTE]
    n = len(steps)
    scale = []
    for k, color in enumerate(steps):
        scale += [[k / n, color], [(k + 1) / n, color]]
    fig.add_trace(go.Heatmap(z=z, hovertext=text, hoverinfo="text", colorscale=scale, zmin=-0.5, zmax=n - 0.5,
                             showscale=False, xgap=1, ygap=1))
    used = sum(len(b) for b in owners.values())
    note = f" (first {shown} of {total})" if shown < total else ""
    n = len(owners)
    who = f"{n} request{'s' * (n != 1)} hold{'s' * (n == 1)}"
    fig.update_layout(title=dict(text=f"KV block map: {who} {used} of {total} blocks{note}"))
    return fig


def compile_timings(events: Sequence[Mapping[str, Any]], stats: Mapping[str, Any] | None = None) -> go.Figure:
    """Seconds spent in each compile mode switch (from session events), and per-size compile
    and decode-program build seconds when the runner's compile_stats() reports them."""
    fig = go.Figure(layout=_layout("Compile timings", "seconds"))
    fig.update_layout(xaxis=dict(title=""))
    events = [e for e in events if e.get("kind") == "compile"]
    if stats is None:  # the latest compile that reported statistics
        stats = next((e["stats"] for e in reversed(events) if e.get("stats")), {})
    per_size = _per_size_seconds(stats)
    decode = (stats.get("decode_programs") or {}).get("build_seconds") or {}
    if not events and not per_size and not decode:
        return _empty(fig, "no compile events yet: toggle compile mode")
    if events:
        labels = [f"#{i + 1} {_compile_label(e)}" for i, e in enumerate(events)]
        colors = [PALETTE[2] if e.get("ok", True) else PALETTE[3] for e in events]
        hover = [e.get("error") or f"{e.get('model', '')}: {e.get('seconds', 0):.2f} s" for e in events]
        fig.add_trace(go.Bar(x=labels, y=[e.get("seconds", 0) for e in events], marker_color=colors,
                             hovertext=hover, hoverinfo="text", name="mode switch"))
    if per_size:
        fig.add_trace(go.Bar(x=[f"size {k}" for k in per_size], y=list(per_size.values()), name="per compile size",
                             marker_color=PALETTE[0]))
    if decode:  # static decode programs: a package build or load (CPU), a CUDA graph capture
        fig.add_trace(go.Bar(x=[f"decode {k}" for k in sorted(decode, key=int)],
                             y=[float(decode[k]) for k in sorted(decode, key=int)], name="decode program",
                             marker_color=PALETTE[1]))
    return fig


def expert_load(rows: Rows, window: float = 5.0) -> go.Figure:
    """An MoE model's tokens routed to each expert of each MoE layer over the rows of the last
    `window` seconds (rows carry `expert_counts` [MoE layers][experts] and `moe_layers`, the
    layers' global indices): a layers x experts heat map."""
    fig = go.Figure(layout=_layout(f"Expert load (tokens routed, last {window:g} s)", ""))
    fig.update_layout(xaxis=dict(title="expert", showgrid=False), yaxis=dict(title="layer", autorange="reversed",
                                                                          showgrid=False, rangemode="normal"))
    rows = [r for r in rows if r.get("expert_counts")]
    if not rows:
        return _empty(fig, "no expert routing yet: load an MoE model (tiny-mixtral) and generate")
    last = rows[-1]
    shape = (len(last["expert_counts"]), len(last["expert_counts"][0]))
    recent = [r for r in rows if last["t"] - r["t"] < window
              and (len(r["expert_counts"]), len(r["expert_counts"][0])) == shape]
    z = [[sum(r["expert_counts"][i][e] for r in recent) for e in range(shape[1])] for i in range(shape[0])]
    layers = last.get("moe_layers") or list(range(shape[0]))
    y = [f"layer {i}" for i in layers]
    x = [f"e{e}" for e in range(shape[1])]
    text = [[f"layer {layers[i]}, expert {e}: {z[i][e]} tokens" for e in range(shape[1])] for i in range(shape[0])]
    fig.add_trace(go.Heatmap(z=z, x=x, y=y, hovertext=text, hoverinfo="text", colorscale="Viridis", zmin=0,
                             colorbar=dict(title="tokens", thickness=12), xgap=1, ygap=1))
    total = sum(map(sum, z))
    fig.update_layout(title=dict(text=f"Expert load: {total} routed tokens in the last {window:g} s "
                                      f"({shape[0]} MoE layers x {shape[1]} experts)"))
    return fig


def all_figures(rows: Rows, events: Sequence[Mapping[str, Any]] = (), block_map: Mapping | None = None,
                compile_stats: Mapping | None = None) -> dict[str, go.Figure]:
    """Every chart of the dashboards, by name."""
    return {
        "memory": memory_breakdown(rows), "blocks": kv_blocks(rows), "waste": waste(rows),
        "throughput": throughput(rows), "block_map": kv_block_map(block_map),
        "compile": compile_timings(events, compile_stats), "expert_load": expert_load(rows),
    }


def _compile_label(e: Mapping[str, Any]) -> str:
    if not e.get("enabled", True):
        return "eager"
    return "/".join(str(x) for x in (e.get("backend"), e.get("mode")) if x)


def _per_size_seconds(stats: Mapping[str, Any]) -> dict:
    for key in ("compile_seconds_per_size", "per_size_seconds", "compile_seconds", "size_seconds"):
        value = stats.get(key)
        if isinstance(value, Mapping) and value:
            return {k: float(v) for k, v in value.items() if isinstance(v, (int, float))}
    return {}


def _natural(request_id: str):
    head, _, tail = str(request_id).rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (str(request_id), 0)
