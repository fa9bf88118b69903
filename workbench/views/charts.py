"""Pure functions from session metrics to plotly figures (no session, no engine, no UI state).

Inputs are plain data: `rows` (dicts from `MetricsSeries`, see workbench/runtime/metrics.py; `t` is
seconds since the model was loaded, `dt` the busy seconds a row covers), `events` (dicts with
`kind`, `t`, ...) and a KV block-map snapshot ({"num_blocks", "owners": {request_id: [block
ids]}, ...}). Every function returns a valid `go.Figure` for empty input too, with a note
saying what will appear. Idle time (no row for more than `GAP_S` seconds) is drawn as a gap,
never as a line across it; `window` picks the rows of recent activity the live charts show (the
last minutes or the last run), and a time axis spans at least `MIN_SPAN_S` seconds. Every chart
takes its colours from `PALETTE` (and `COLORS`, the colour of each quantity, the same in every
chart); other views (workbench/views/timeline.py) do too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

MIB = 2**20
HEIGHT = 320
GAP_S = 0.5  # idle seconds between rows drawn as a gap (rows are written every 0.1 s while busy)
# The live charts' window on recent activity: the last N minutes up to the latest row, or the last run
# (the rows after the latest idle stretch of RUN_GAP_S or more, or after the latest event starting a run).
WINDOW_MODES = ("minutes", "run")
WINDOW_MINUTES = 2.0
RUN_GAP_S = 5.0
RUN_EVENTS = ("load", "workload", "load_start", "tune", "compile")  # load_start: a tuning run (run_load)
MIN_SPAN_S = 5.0  # a time axis spans at least this (a lone row at 80 µs would get µs ticks)
TIME_AXIS = "seconds since the model was loaded"
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D",
           "#EECA3B", "#79706E")
# plotly_white's look, just the settings these charts show: the full template is about 6 kB of JSON and 15 ms of
# validation a figure, paid by every figure at every live refresh (a page's refresh then outran its period)
TEMPLATE = go.layout.Template(layout=dict(
    paper_bgcolor="white", plot_bgcolor="white", colorway=PALETTE, font=dict(color="#2a3f5f"), hovermode="closest",
    **{axis: dict(gridcolor="#EBF0F8", linecolor="#EBF0F8", zerolinecolor="#EBF0F8", ticks="", automargin=True)
       for axis in ("xaxis", "yaxis")}))
FREE_COLOR, CACHED_COLOR = "#DCE3EA", "#A9B4C2"  # free and cached KV blocks, in every chart
SHARED_COLOR = "#3D4B5C"  # a KV block several requests hold (a prefix-cache hit, a parallel-sampling fork)
COLORS = {  # one colour per quantity, whichever chart shows it
    "weights": PALETTE[0], "activations": PALETTE[5], "kv_used": PALETTE[1], "kv_cached": CACHED_COLOR,
    "kv_free": FREE_COLOR, "prefill": PALETTE[0], "decode": PALETTE[1], "paged": PALETTE[2],
    "contiguous": PALETTE[3], "ok": PALETTE[2], "failed": PALETTE[3], "compile_size": PALETTE[0],
    "decode_program": PALETTE[1], "weights_dense": PALETTE[9],
}
# tokens routed per expert: white to the palette's first colour
HEAT_SCALE = [[0.0, "#FFFFFF"], [1.0, PALETTE[0]]]

Rows = Sequence[Mapping[str, Any]]


def base_layout(title: str, y_title: str = "", **extra) -> dict:
    return dict(
        title=dict(text=title, x=0.01, xanchor="left", y=0.98, yanchor="top", font=dict(size=14)),
        height=HEIGHT, autosize=True, template=TEMPLATE, font=dict(size=12),
        margin=dict(l=60, r=20, t=40, b=40),
        # the legend sits under the plot, below the x-axis title (its margin grows to fit it)
        legend=dict(orientation="h", x=0, xanchor="left", y=-0.22, yanchor="top"),
        xaxis=dict(title=dict(text=TIME_AXIS, standoff=6), rangemode="tozero", automargin=True),
        yaxis=dict(title=dict(text=y_title, standoff=6), rangemode="tozero", automargin=True),
        uirevision=title,  # keep the user's zoom across live updates
        **extra)


def empty_note(fig: go.Figure, note: str) -> go.Figure:
    """`fig` without data, laid out as it will be with data (its axes, titles and margins where they will stand,
    over an empty range), the note in the middle saying what will appear and how to make it appear."""
    time_axis = fig.layout.xaxis.title.text == TIME_AXIS
    fig.update_xaxes(range=[0, MIN_SPAN_S] if time_axis else [0, 1], showticklabels=time_axis)
    fig.update_yaxes(range=[0, 1], showticklabels=False)
    fig.add_annotation(text=note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(color=PALETTE[9]), bgcolor="rgba(255,255,255,0.85)")
    return fig


def segments(rows: Rows, gap_s: float = GAP_S) -> list[list[Mapping[str, Any]]]:
    """`rows` split where the model was idle for more than `gap_s` seconds (a row covers
    `dt` busy seconds up to its `t`)."""
    out: list[list[Mapping[str, Any]]] = []
    for r in rows:
        if out and r["t"] - r.get("dt", 0.0) - out[-1][-1]["t"] > gap_s:
            out.append([])
        if not out:
            out.append([])
        out[-1].append(r)
    return out


def window(rows: Rows, mode: str = "minutes", minutes: float = WINDOW_MINUTES,
           events: Sequence[Mapping[str, Any]] = (), run_gap_s: float = RUN_GAP_S) -> list[Mapping[str, Any]]:
    """The rows the live charts show: `mode` "minutes", those of the last `minutes` up to the latest
    row; "run", those after the latest idle stretch of `run_gap_s` or more and after the latest
    `events` entry (its `t` on the rows' clock) of a kind in RUN_EVENTS that came before the latest row."""
    if mode not in WINDOW_MODES:
        raise ValueError(f"chart window mode {mode!r}: use one of {', '.join(WINDOW_MODES)}")
    if mode == "minutes" and not minutes > 0:
        raise ValueError(f"chart window of {minutes} minutes: give a positive number of minutes")
    if not rows:
        return []
    end = rows[-1]["t"]
    if mode == "minutes":
        start = end - 60.0 * minutes
    else:
        first = segments(rows, run_gap_s)[-1][0]
        starts = [e["t"] for e in events if e.get("kind") in RUN_EVENTS and e["t"] <= end]
        start = max([first["t"] - first.get("dt", 0.0), *starts])
    return [r for r in rows if r["t"] >= start]


def _time_axis(fig: go.Figure, rows: Rows) -> go.Figure:
    """Autorange the time axis over at least MIN_SPAN_S seconds ending at the latest row (from 0 when
    the rows start earlier than that), so a short run fills a readable axis in seconds."""
    lo, hi = rows[0]["t"], rows[-1]["t"]
    if hi - lo < MIN_SPAN_S:
        fig.update_xaxes(autorangeoptions=dict(include=[max(0.0, hi - MIN_SPAN_S), max(hi, MIN_SPAN_S)]))
    return fig


def _broken(rows: Rows, y: Callable[[Mapping[str, Any]], Any], gap_s: float) -> tuple[list, list]:
    """x and y of a line with a None break at every idle gap (plotly draws no line across it)."""
    xs: list = []
    ys: list = []
    for k, seg in enumerate(segments(rows, gap_s)):
        if k:
            xs.append(None)
            ys.append(None)
        xs += [r["t"] for r in seg]
        ys += [y(r) for r in seg]
    return xs, ys


def _stacked(fig: go.Figure, rows: Rows, series: Sequence[tuple[str, Callable, str]], group: str,
             gap_s: float, unit: str) -> None:
    """Stacked areas of `series` (label, row -> value, colour), one stack per busy stretch: a
    stack cannot break at a None, so each stretch is its own set of traces (one legend entry)."""
    for k, seg in enumerate(segments(rows, gap_s)):
        x = [r["t"] for r in seg]
        for label, value, color in series:
            fig.add_trace(go.Scatter(
                x=x, y=[value(r) for r in seg], name=label, legendgroup=label, showlegend=k == 0,
                stackgroup=f"{group}-{k}", mode="lines" if len(seg) > 1 else "markers",
                line=dict(width=0.5, color=color), fillcolor=color, marker=dict(color=color, size=6),
                hovertemplate=f"{label}: %{{y:.4~f}} {unit}<extra>%{{x:.1f}} s</extra>"))


def _get(key: str, scale: float = 1.0) -> Callable[[Mapping[str, Any]], Any]:
    return lambda r: None if r.get(key) is None else r[key] * scale


def memory_breakdown(rows: Rows, gap_s: float = GAP_S) -> go.Figure:
    """Stacked memory of the model over time (MiB): weights, KV pool split into blocks in use,
    cached (reusable prefix blocks) and free, plus the activation peak when the runner reports it."""
    fig = go.Figure(layout=base_layout("Memory of the model (MiB)", "MiB"))
    rows = [r for r in rows if r.get("kv_pool_bytes") is not None]
    if not rows:
        return empty_note(fig, "appears once a model is loaded: press Load model")

    def kv(key):  # MiB held by the blocks counted in `key`
        return lambda r: r.get(key, 0) * r["kv_pool_bytes"] / r["blocks_total"] / MIB if r.get("blocks_total") else 0

    series = [("weights", _get("weights_bytes", 1 / MIB), COLORS["weights"])]
    act_key = next((k for k in ("activation_peak_bytes", "activations_peak_bytes") if rows[-1].get(k)), None)
    if act_key:
        series.append(("activations (peak)", _get(act_key, 1 / MIB), COLORS["activations"]))
    series += [("KV in use", kv("blocks_used"), COLORS["kv_used"]),
               ("KV cached", kv("blocks_cached"), COLORS["kv_cached"]),
               ("KV free", lambda r: kv("blocks_free")(r) - kv("blocks_cached")(r), COLORS["kv_free"])]
    _stacked(fig, rows, series, "mem", gap_s, "MiB")
    return _time_axis(fig, rows)


def weights_storage(info: Mapping[str, Any] | None) -> go.Figure:
    """The weights at their stored size beside what they would take in the compute dtype (MiB), from
    `info`: model_info()["quantization"] with the compute "dtype" ({"format", "group_size", "lm_head",
    "weights_bytes", "dense_bytes", "dtype"}); the title says what the storage format saved."""
    fig = go.Figure(layout=base_layout("Weights: stored vs the compute dtype (MiB)", "", barmode="group"))
    fig.update_xaxes(title_text="MiB", rangemode="tozero")
    fig.update_yaxes(title_text="weights", autorange="reversed")
    if not info or info.get("dense_bytes") is None:
        return empty_note(fig, "appears once a model is loaded: press Load model")
    fmt, dtype = info.get("format"), info.get("dtype", "compute dtype")
    stored = fmt + (f" g{info['group_size']}" if fmt == "int4" else "") + (
        " + LM head" if info.get("lm_head") else "") if fmt else dtype
    names = [f"stored ({stored})", f"in {dtype}"]
    values = [info["weights_bytes"] / MIB, info["dense_bytes"] / MIB]
    fig.add_trace(go.Bar(
        y=names, x=values, orientation="h", showlegend=False, text=[f"{v:.1f} MiB" for v in values],
        textposition="auto", marker_color=[COLORS["weights"], COLORS["weights_dense"]],
        hovertemplate="%{y}: %{x:.1f} MiB<extra></extra>"))
    saved = 1 - info["weights_bytes"] / info["dense_bytes"] if info["dense_bytes"] else 0.0
    fig.update_layout(title_text=f"Weights stored as {stored}: {saved:.0%} less than {dtype} (MiB)" if fmt else
                      f"Weights in {dtype}, no storage format (MiB)")
    return fig


def empty_blocks(row: Mapping[str, Any]) -> int:
    """Free blocks holding nothing: a record's `blocks_free` counts the cached ones too (they can be reused)."""
    return row["blocks_free"] - row["blocks_cached"]


def kv_blocks(rows: Rows, gap_s: float = GAP_S) -> go.Figure:
    """KV pool blocks used / cached / free over time (stacked: they add up to the pool)."""
    fig = go.Figure(layout=base_layout("KV cache blocks", "blocks"))
    rows = [r for r in rows if r.get("blocks_total") is not None]
    if not rows:
        return empty_note(fig, "appears once a model is loaded: press Load model")
    _stacked(fig, rows, [("used", _get("blocks_used"), COLORS["kv_used"]),
                         ("cached", _get("blocks_cached"), COLORS["kv_cached"]),
                         ("free", empty_blocks, COLORS["kv_free"])], "blocks", gap_s, "blocks")
    return _time_axis(fig, rows)


def waste(rows: Rows, gap_s: float = GAP_S) -> go.Figure:
    """Wasted KV slots (%): the paged pool (unused slots in partly filled blocks) against a
    contiguous per-request max_model_len reservation of the same requests (a static cache)."""
    fig = go.Figure(layout=base_layout("Wasted KV slots: paged vs contiguous reservation (%)", "% of reserved slots"))
    fig.update_yaxes(range=[0, 100], dtick=25)
    rows = [r for r in rows if r.get("internal_fragmentation") is not None]
    if not rows:
        return empty_note(fig, "appears while requests run: press Generate or Run workload")
    for name, key, color in (("contiguous max_model_len reservation", "static_reservation_waste", COLORS["contiguous"]),
                             ("paged (partly filled blocks)", "internal_fragmentation", COLORS["paged"])):
        x, y = _broken(rows, _get(key, 100), gap_s)
        fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines+markers", marker=dict(size=4, color=color),
                                 line=dict(color=color), connectgaps=False,
                                 hovertemplate=f"{name}: %{{y:.1f}} %<extra>%{{x:.1f}} s</extra>"))
    return _time_axis(fig, rows)


def throughput(rows: Rows, window: float = 1.0, gap_s: float = GAP_S) -> go.Figure:
    """Prompt tokens (prefill) and generated tokens (decode) per second, each averaged over the
    busy time of the last `window` seconds: one axis, one unit."""
    fig = go.Figure(layout=base_layout("Throughput (tokens/s)", "tokens/s"))
    rows = [r for r in rows if r.get("steps")]
    if not rows:
        return empty_note(fig, "appears while requests run: press Generate or Run workload")
    for name, key, color in (("prompt tokens/s (prefill)", "prefill_tokens", COLORS["prefill"]),
                             ("generated tokens/s (decode)", "sampled_tokens", COLORS["decode"])):
        rate = dict(zip(map(id, rows), rolling_rate(rows, key, window)))
        x, y = _broken(rows, lambda r, rate=rate: rate[id(r)], gap_s)
        fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines", line=dict(color=color, width=2),
                                 connectgaps=False, hovertemplate=f"{name}: %{{y:.0f}}<extra>%{{x:.1f}} s</extra>"))
    return _time_axis(fig, rows)


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


def kv_block_map(snapshot: Mapping[str, Any] | None, columns: int = 64, max_blocks: int = 4096,
                 when: str = "") -> go.Figure:
    """Which request owns which KV block, one cell per block (a colour per request, a dark one for a block
    several hold, its hover naming them; cached prefix blocks grey when the snapshot names them). Pools larger
    than `max_blocks` show
    the low end, where the allocator places blocks first. `when` follows the title's "KV block map"."""
    fig = go.Figure(layout=base_layout("KV block map (who owns which block)", ""))
    fig.update_layout(xaxis=dict(title=dict(text=f"block id mod {columns} (one cell per block)"), showticklabels=False,
                                 showgrid=False, zeroline=False, rangemode="normal"),
                      yaxis=dict(title=dict(text=f"block id ÷ {columns}"), autorange="reversed", showgrid=False,
                                 zeroline=False, rangemode="normal"), showlegend=False)
    if not snapshot or not snapshot.get("num_blocks"):
        return empty_note(fig, "appears once a model is loaded: press Load model")
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
    holders: dict[int, list[str]] = {}
    for i, (rid, blocks) in enumerate(sorted(owners.items(), key=lambda kv: _natural(kv[0]))):
        for b in blocks:
            if b < shown:
                holders.setdefault(b, []).append(rid)
                shared = len(holders[b]) > 1
                z[b // columns][b % columns] = 2 if shared else 3 + i % len(PALETTE)
                text[b // columns][b % columns] = f"block {b}: {'shared by ' * shared}{', '.join(holders[b])}"
    for c in range(shown, n_rows * columns):  # cells past the end of the pool
        z[c // columns][c % columns] = None
    steps = [FREE_COLOR, CACHED_COLOR, SHARED_COLOR, *PALETTE]
    n = len(steps)
    scale = []
    for k, color in enumerate(steps):
        scale += [[k / n, color], [(k + 1) / n, color]]
    fig.add_trace(go.Heatmap(z=z, hovertext=text, hoverinfo="text", colorscale=scale, zmin=-0.5, zmax=n - 0.5,
                             showscale=False, xgap=1, ygap=1))
    used = len({b for blocks in owners.values() for b in blocks})  # a shared block once
    note = f" (first {shown} of {total})" if shown < total else ""
    n, num_shared = len(owners), sum(len(h) > 1 for h in holders.values())
    who = f"{n} request{'s' * (n != 1)} hold{'s' * (n == 1)}"
    shared = f", {num_shared} shared" if num_shared else ""
    fig.update_layout(title=dict(text=f"KV block map{when}: {who} {used} of {total} blocks{shared}{note}"))
    return fig


def compile_timings(events: Sequence[Mapping[str, Any]], stats: Mapping[str, Any] | None = None) -> go.Figure:
    """Seconds spent in each compile mode switch (from session events), and per-size compile
    and decode-program build seconds when the runner's compile_stats() reports them."""
    fig = go.Figure(layout=base_layout("Compile time (s)", "seconds"))
    fig.update_layout(xaxis=dict(title=dict(text="mode switch, compile size, decode program"), rangemode="normal"))
    events = [e for e in events if e.get("kind") == "compile"]
    if stats is None:  # the latest compile that reported statistics
        stats = next((e["stats"] for e in reversed(events) if e.get("stats")), {})
    per_size = _per_size_seconds(stats)
    decode = (stats.get("decode_programs") or {}).get("build_seconds") or {}
    if not events and not per_size and not decode:
        return empty_note(fig, "appears after a compile: tick torch.compile, then Apply compile mode")
    if events:
        labels = [f"#{i + 1} {_compile_label(e)}" for i, e in enumerate(events)]
        colors = [COLORS["ok"] if e.get("ok", True) else COLORS["failed"] for e in events]
        hover = [e.get("error") or f"{e.get('model', '')}: {e.get('seconds', 0):.2f} s" for e in events]
        fig.add_trace(go.Bar(x=labels, y=[e.get("seconds", 0) for e in events], marker_color=colors,
                             hovertext=hover, hoverinfo="text", name="mode switch"))
    if per_size:
        fig.add_trace(go.Bar(x=[f"size {k}" for k in per_size], y=list(per_size.values()), name="per compile size",
                             marker_color=COLORS["compile_size"]))
    if decode:  # static decode programs: a package build or load (CPU), a CUDA graph capture
        fig.add_trace(go.Bar(x=[f"decode {k}" for k in sorted(decode, key=int)],
                             y=[float(decode[k]) for k in sorted(decode, key=int)], name="decode program",
                             marker_color=COLORS["decode_program"]))
    return fig


def expert_load(rows: Rows, window: float = 5.0) -> go.Figure:
    """An MoE model's tokens routed to each expert of each MoE layer over the rows of the last
    `window` seconds (rows carry `expert_counts` [MoE layers][experts] and `moe_layers`, the
    layers' global indices): a layers x experts heat map."""
    fig = go.Figure(layout=base_layout(f"Expert load (tokens routed, last {window:g} s)", ""))
    fig.update_layout(xaxis=dict(title=dict(text="expert"), showgrid=False, rangemode="normal"),
                      yaxis=dict(title=dict(text="MoE layer"), autorange="reversed", showgrid=False,
                                 rangemode="normal"))
    rows = [r for r in rows if r.get("expert_counts")]
    if not rows:
        return empty_note(fig, "no expert routing yet:<br>load an MoE model (tiny-mixtral) and generate")
    last = rows[-1]
    shape = (len(last["expert_counts"]), len(last["expert_counts"][0]))
    recent = [r for r in rows if last["t"] - r["t"] < window
              and (len(r["expert_counts"]), len(r["expert_counts"][0])) == shape]
    z = [[sum(r["expert_counts"][i][e] for r in recent) for e in range(shape[1])] for i in range(shape[0])]
    layers = last.get("moe_layers") or list(range(shape[0]))
    y = [f"layer {i}" for i in layers]
    x = [f"e{e}" for e in range(shape[1])]
    text = [[f"layer {layers[i]}, expert {e}: {z[i][e]} tokens" for e in range(shape[1])] for i in range(shape[0])]
    fig.add_trace(go.Heatmap(z=z, x=x, y=y, hovertext=text, hoverinfo="text", colorscale=HEAT_SCALE, zmin=0,
                             colorbar=dict(title="tokens", thickness=12), xgap=1, ygap=1))
    total = sum(map(sum, z))
    fig.update_layout(title=dict(text=f"Expert load: {total} routed tokens in the last {window:g} s "
                                      f"({shape[0]} MoE layers x {shape[1]} experts)"))
    return fig


def all_figures(rows: Rows, events: Sequence[Mapping[str, Any]] = (), block_map: Mapping | None = None,
                compile_stats: Mapping | None = None, weights: Mapping | None = None) -> dict[str, go.Figure]:
    """Every chart of the dashboards, by name (`weights`: see `weights_storage`)."""
    return {
        "memory": memory_breakdown(rows), "weights": weights_storage(weights), "blocks": kv_blocks(rows),
        "waste": waste(rows),
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
