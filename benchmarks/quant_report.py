"""benchmarks/quant.py's tables and the targets set for the weight formats, from the figures its processes returned.

`report(results)` prints one table per model (a row per format and llama.cpp file type), the tiny-speaker
perplexity table and each target's verdict (met, or missed by how much), every line naming the CPU and
kernel tier; it returns the same as a dict for the JSON line. The speed targets (bandwidth share, speedups
over float32, the mixed workload) are refused when `results["quiet"]` says the machine was not quiet at the
start (benchmarks/verdicts.py); memory and perplexity do not depend on it.
"""

from __future__ import annotations

import statistics

try:  # run as a script: benchmarks/ is on sys.path
    import verdicts
except ImportError:  # imported as benchmarks.quant_report
    from benchmarks import verdicts

MIB = 1 << 20
RSS_SLACK, PEAK_RATIO, BANDWIDTH_SHARE = 1.1, 1.25, 0.75
HEAD_SPEEDUPS = {"int8+head": 3.0, "int4-g64+head": 5.0}  # batch-1 over our float32
PPL_BOUNDS = {"int8": 0.01, "int4-g32": 0.05, "int4-g64": 0.05, "int4-g128": 0.05,
              "int8+head": 0.01, "int4-g64+head": 0.05}
PEERS = {"int8": "llama.cpp q8_0", "int8+head": "llama.cpp q8_0", "int4-g32": "llama.cpp q4_0",
         "int4-g64+head": "llama.cpp q4_0", "none": "llama.cpp f32"}


def spread(values: list[float]) -> dict | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def _fmt(s: dict | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def model_rows(figures: dict) -> dict:
    """{row name: its figures}: memory and quality from the start reply, speed over the rounds."""
    rows = {}
    for name, start in figures["starts"].items():
        t = figures["timings"].get(name, {})
        b1 = spread(t.get("batch1", []))
        shares = [tok * start["read_bytes"] / 1e9 / bw for tok, bw in zip(t.get("batch1", []), t.get("bandwidth", []))]
        err, agree = start.get("logit_error"), start.get("agreement")
        rows[name] = {
            "rss_mib": start["rss_mib"], "peak_rss_mib": start["peak_rss_mib"], "load_s": start["load_s"],
            "weights_mib": start["weights_bytes"] / MIB, "read_mib": start["read_bytes"] / MIB,
            "kv_pool_mib": start.get("kv_pool_bytes", 0) / MIB, "batch1_tok_s": b1,
            "batch1_gb_s": spread([tok * start["read_bytes"] / 1e9 for tok in t.get("batch1", [])]),
            "bandwidth_share": spread(shares), "mixed_tok_s": spread(t.get("mixed", [])),
            "logit_max": err["max"] if err else 0.0, "logit_mean": err["mean"] if err else 0.0,
            "logit_scale": err["ref_mean_abs"] if err else None,
            "agreement": agree["fraction"] if agree else 1.0}
    return rows


def print_table(model: str, rows: dict, tag: str) -> None:
    print(f"\n{model} ({tag}); batch-1 and mixed: median [range] tok/s")
    print(f"{'format':<18}{'RSS':>7}{'peak':>7}{'stored':>8}{'KV':>6}{'load s':>7}  {'batch-1 tok/s':<20}"
          f"{'% bw':>6}  {'mixed tok/s':<22}{'logit max':>10}{'mean':>8}{'agree':>7}")
    for name, r in rows.items():
        share = f"{100 * r['bandwidth_share']['median']:.0f}" if r["bandwidth_share"] else "-"
        print(f"{name:<18}{r['rss_mib']:>7.0f}{r['peak_rss_mib']:>7.0f}{r['weights_mib']:>8.0f}{r['kv_pool_mib']:>6.0f}"
              f"{r['load_s']:>7.1f}  {_fmt(r['batch1_tok_s']):<20}{share:>6}  {_fmt(r['mixed_tok_s']):<22}"
              f"{r['logit_max']:>10.3f}{r['logit_mean']:>8.4f}{r['agreement']:>7.3f}")
    print("(MiB; stored = the weights as held; % bw = weight bytes read per token x tok/s over the round's probed "
          "bandwidth; logit error and agreement against the float32 reference)")


def _verdict(ok: bool, text: str, quiet: verdicts.Quiet | None = None) -> str:
    return f"{verdicts.outcome(ok, quiet, words=('met', 'MISSED'))}: {text}"


def model_targets(model: str, rows: dict, quiet: verdicts.Quiet | None = None) -> list[str]:
    """Each target's line for one model's rows; `quiet`: the machine at the start (the speed targets)."""
    out = []
    for name, r in rows.items():
        if name.startswith("llama.cpp"):
            continue
        limit = RSS_SLACK * r["weights_mib"] + r["kv_pool_mib"] + 300
        out.append(_verdict(r["rss_mib"] <= limit, f"{model} {name}: RSS after load {r['rss_mib']:.0f} MiB <= "
                            f"{limit:.0f} (1.1 x stored + KV + 300 MiB)"))
        peak = r["peak_rss_mib"] / r["rss_mib"]
        out.append(_verdict(peak <= PEAK_RATIO, f"{model} {name}: peak during load {r['peak_rss_mib']:.0f} MiB = "
                            f"{peak:.2f} x the final (<= 1.25)"))
        if r["bandwidth_share"]:
            share = r["bandwidth_share"]["median"]
            out.append(_verdict(share >= BANDWIDTH_SHARE, f"{model} {name}: batch-1 reads {100 * share:.0f}% of "
                                f"the bandwidth (>= 75%)", quiet))
    base = rows.get("none", {}).get("batch1_tok_s")
    for name, want in HEAD_SPEEDUPS.items():
        if base and rows.get(name, {}).get("batch1_tok_s"):
            x = rows[name]["batch1_tok_s"]["median"] / base["median"]
            out.append(_verdict(x >= want, f"{model} {name}: batch-1 {x:.2f}x our float32 (>= {want:g}x)", quiet))
    mixed = rows.get("none", {}).get("mixed_tok_s")
    if mixed and rows.get("int8", {}).get("mixed_tok_s"):
        x = rows["int8"]["mixed_tok_s"]["median"] / mixed["median"]
        out.append(_verdict(x >= 1.0, f"{model} int8: mixed workload {x:.2f}x our float32 (>= 1x)", quiet))
    for ours, peer in PEERS.items():
        if rows.get(ours, {}).get("batch1_tok_s") and rows.get(peer, {}).get("batch1_tok_s"):
            x = rows[ours]["batch1_tok_s"]["median"] / rows[peer]["batch1_tok_s"]["median"]
            out.append(f"compared: {model} batch-1 {ours} / {peer} = {x:.2f}")
    return out


def perplexity_targets(ppl: dict) -> list[str]:
    base = ppl.get("none", {}).get("perplexity")
    out = []
    for name, bound in PPL_BOUNDS.items():
        if base and name in ppl:
            rel = ppl[name]["perplexity"] / base - 1
            out.append(_verdict(abs(rel) <= bound, f"tiny-speaker {name}: perplexity {ppl[name]['perplexity']:.3f} vs "
                                f"{base:.3f}, {100 * rel:+.2f}% (within {100 * bound:g}%)"))
    return out


def report(results: dict) -> dict:
    tag = results["tag"]
    summary = {"tag": tag, "models": {}, "targets": []}
    for model, figures in results["models"].items():
        rows = model_rows(figures)
        bw = figures.get("bandwidth")
        print_table(model, rows, tag)
        if bw:
            print(f"memory bandwidth in the rounds: sum {_fmt(bw['sum'])} GB/s, copy {_fmt(bw['copy'])} GB/s")
        summary["models"][model] = rows
        summary["targets"] += model_targets(model, rows, results.get("quiet"))
    ppl = results.get("perplexity", {})
    if ppl:
        print(f"\ntiny-speaker perplexity on held-out prose ({next(iter(ppl.values()))['tokens']} tokens; {tag})")
        for name, p in ppl.items():
            print(f"  {name:<16}{p['perplexity']:>9.3f}")
    summary["perplexity"] = ppl
    summary["targets"] += perplexity_targets(ppl)
    print(f"\ntargets ({tag}):")
    for line in summary["targets"]:
        print(f"  {line}")
    for name, why in results.get("errors", {}).items():
        print(f"  not run: {name}: {why}")
    return summary
