"""The closing summary of benchmarks/throughput.py: one line per figure, each starting with the model,
the dtype, the CPU model and runner_core's kernel tier, so that a line copied out of a `make bench` log
still says what it measured. Per mode (eager, compiled), ours beside vLLM: mixed-workload throughput,
batch-1 decode with its share of the measured bandwidth; per start condition: load time (the engine's
constructor) and resident memory after load (RSS of the engine's processes), ours with its weights,
their panel copies and its KV pool."""

from __future__ import annotations

try:  # run as a script: benchmarks/ is on sys.path
    import verdicts
except ImportError:  # imported as benchmarks.summary
    from benchmarks import verdicts

MODES = ("eager", "compiled")
CONDITIONS = ("eager", "compiled, caches cold", "compiled, caches warm")


def _ratio(ours: float, peer: float, mode: str, devices: dict) -> str:
    """ours / vLLM through verdicts.ratio (like with like), or why there is none."""
    try:
        r = verdicts.ratio(verdicts.Figure(ours, devices.get(f"ours {mode}", "?"), mode, "ours"),
                           verdicts.Figure(peer, devices.get(f"vllm {mode}", "?"), mode, "vLLM"))
    except verdicts.UnlikeFigures as e:
        return f"no ratio ({e})"
    return f"ours/vLLM {r:.2f}x"


def _side(label: str, name: str, figures: dict, extra: dict | None = None) -> str:
    if name not in figures:
        return f"{label} not measured"
    note = "" if not extra or extra.get(name) is None else f" ({100 * extra[name]:.0f}% of the bandwidth)"
    return f"{label} {figures[name]['median']:.1f} tok/s{note}"


def _start(label: str, s: dict | None) -> str:
    if s is None:
        return f"{label} not started"
    parts = [f"{k} {v:.0f}" for k, v in (s.get("memory_mib") or {}).items()]
    inside = f" ({', '.join(parts)} MiB)" if parts else ""
    return f"{label} load {s['load_s']:.1f} s, RSS {s['rss_mib']:.0f} MiB{inside}"


def summary_lines(model: str, dtype: str, tag: str, tok_s: dict, batch1: dict, share: dict, starts: dict,
                  devices: dict) -> list[str]:
    """The summary's lines. `tok_s` and `batch1`: {engine name: {"median", ...}} ("ours eager", "vllm
    compiled", ...); `share`: {engine name: batch-1 bandwidth share or None}; `starts`: {(engine name,
    condition): the engine's start-up reply}; `devices`: {engine name: device}. `tag` names the CPU
    model and kernel tier (machine.run_tag)."""
    head = f"[{model}, {dtype}; {tag}]"
    lines = []
    for mode in MODES:
        pair = [f"ours {mode}", f"vllm {mode}"]
        if not any(name in tok_s or name in batch1 for name in pair):
            continue
        for what, figures, extra in (("mixed workload", tok_s, None), ("batch-1 decode", batch1, share)):
            ratio = _ratio(figures[pair[0]]["median"], figures[pair[1]]["median"], mode, devices) \
                if all(name in figures for name in pair) else "no ratio"
            lines.append(f"{head} {what}, {mode}: {_side('ours', pair[0], figures, extra)}; "
                         f"{_side('vLLM', pair[1], figures, extra)}; {ratio}")
    for condition in CONDITIONS:
        mode = condition.split(",")[0]
        pair = [starts.get((f"{side} {mode}", condition)) for side in ("ours", "vllm")]
        if any(pair):
            lines.append(f"{head} start, {condition}: {_start('ours', pair[0])}; {_start('vLLM', pair[1])}")
    return lines
