"""Tuning sessions measured: serving over HTTP against in process, a maintained load generator against
ours, a sweep's knob changes and overhead, and whether its recommendation holds on a re-run.

  serving   `--model` (default small-llama) loaded in a workbench Session, its OpenAI-compatible API on
            loopback (session.serve_api). One workload: `--num-prompts` requests, prompts of exactly
            `--input-len` token ids and `--output-len` output tokens (greedy, EOS ignored), kept
            `--concurrency` in flight. Three clients take turns over `--repeats` rounds (A B C A B C ...):
              in process   session.run_load: requests submitted to the session, no HTTP
              http (ours)  runner_core.tuning.http_load in a client process of its own, streaming
                           /v1/completions
              vllm bench   `vllm bench serve` (vLLM 0.32's serving benchmark, from .venv-peers: make
                           bench-peers) in its process, random dataset of the same lengths, same concurrency
            For each: output tok/s, TTFT and TPOT p50/p99 (median and range over the rounds). The costs of
            HTTP: 1 - http/in-process throughput (target <= 5%) and the TTFT p50 difference (target <= 5 ms).
            vLLM's random prompts are text re-tokenized by our server, so their prompt lengths differ a little.
            vLLM's saved result is read back: its prompt and output lengths (input_lens, output_lens), one per
            request, must be the lengths asked within LENGTH_SLACK, else vllm bench leaves the comparison
            saying why (its figures would be of another workload); the lengths go in the JSON line
  knobs     seconds of session.reconfigure for each kind: max_num_seqs (scheduler), block_size and the KV
            budget (pool rebuilt), each changed and changed back (target <= 1 s; no weight is reloaded)
  sweep     session.tune with the space proposed from the KV capacity (propose_space), the workload of
            `--sweep-requests` requests (uniform prompt and output lengths) under `--target-metric` <=
            `--target-ms`: points, wall time, the overhead (share of wall time not generating; target <= 10%),
            the recommendation with its margin, the Pareto frontier, the rows in `--results` (CSV, resumable)
  re-run    the recommended point applied again and its workload re-run 3 times: its target metric against
            the recommendation's value and margin (target: within the margin)
Every figure names the CPU and kernel tier; the targets are reported, never enforced; the last stdout line
is one JSON object.

Run:  make bench-serve   or   .venv/bin/python benchmarks/serve.py [--quick] [--no-peer] [--no-sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import runner_core  # noqa: F401  (before torch: runner_core sets OpenMP's wait policy as torch loads)

try:  # run as a script: benchmarks/ is on sys.path
    import machine
except ImportError:  # run as `python -m benchmarks.serve`
    from benchmarks import machine

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
FIGURES = ("output_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
VLLM_KEYS = {"output_throughput": "output_throughput", "ttft_p50_ms": "median_ttft_ms", "ttft_p99_ms": "p99_ttft_ms",
             "tpot_p50_ms": "median_tpot_ms", "tpot_p99_ms": "p99_tpot_ms"}
LENGTH_SLACK = 0.05  # share a vLLM prompt or output may differ from the length asked (its random text re-encoded)
VLLM_BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep-requests", type=int, default=32)
    ap.add_argument("--target-metric", default="tpot_p99_ms")
    ap.add_argument("--target-ms", type=float, default=100.0)
    ap.add_argument("--results", default=None, help="the sweep's rows (CSV; a re-run resumes); default: a temp file")
    ap.add_argument("--no-peer", action="store_true", help="skip vllm bench serve")
    ap.add_argument("--no-sweep", action="store_true", help="serving and knob figures only")
    ap.add_argument("--chart", default=None, help="write the sweep's Pareto chart here as a PNG (Chromium draws it)")
    ap.add_argument("--quick", action="store_true", help="a small run: 16 prompts, 2 repeats, an 8-request sweep")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # internal: run the HTTP client (a JSON spec) and exit
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.repeats, args.sweep_requests = 16, 2, 8
    return args


# ---- the clients -------------------------------------------------------------------------------------
def serving_workload(args):
    from runner_core.tuning import Arrivals, Lengths, Workload

    return Workload(num_requests=args.num_prompts, arrivals=Arrivals.fixed_concurrency(args.concurrency),
                    prompt_len=Lengths.fixed(args.input_len), output_len=Lengths.fixed(args.output_len),
                    temperature=0.0, ignore_eos=True, seed=1)


def run_client(spec: str) -> None:
    """The HTTP client process: run_http_workload with the spec's workload, print the summary as JSON."""
    from runner_core.tuning import Workload
    from runner_core.tuning.http_load import run_http_workload

    s = json.loads(spec)
    cpu = time.process_time()
    result = run_http_workload(s["url"], s["model"], Workload.from_dict(s["workload"]), vocab_size=s["vocab_size"])
    print(json.dumps({**result.summary, "client_cpu_s": time.process_time() - cpu}))


def http_ours(url: str, model: str, workload, vocab_size: int) -> dict:
    spec = json.dumps({"url": url, "model": model, "workload": workload.to_dict(), "vocab_size": vocab_size})
    res = subprocess.run([sys.executable, __file__, "--client", spec], capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"the HTTP client failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def vllm_bench(url: str, model: str, tokenizer: Path, args, out_dir: Path, round_no: int) -> dict:
    name = f"vllm-bench-{round_no}.json"
    cmd = [str(PEER_PYTHON), "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url, "--endpoint",
           "/v1/completions", "--model", str(tokenizer), "--served-model-name", model, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0", "--seed",
           str(round_no), "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-result", "--result-dir",
           str(out_dir), "--result-filename", name]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if res.returncode:
        raise RuntimeError(f"vllm bench serve failed: {(res.stderr or res.stdout)[-2000:]}")
    return read_vllm_result(out_dir / name, args)


def read_vllm_result(path: Path, args) -> dict:
    """vllm bench serve's saved result: its figures (VLLM_KEYS) and the lengths it sent and got back
    ("input_lens", "output_lens": min, median, max), each request's checked against `--input-len` and
    `--output-len`; RuntimeError when a request failed, a length is missing or one is off by more than
    LENGTH_SLACK (its figures would be of another workload than the other clients')."""
    data = json.loads(path.read_text())
    if data.get("failed"):
        raise RuntimeError(f"vllm bench serve: {data['failed']} requests failed")
    lengths = {}
    for key, asked in (("input_lens", args.input_len), ("output_lens", args.output_len)):
        got = data.get(key)
        if not isinstance(got, list) or len(got) != args.num_prompts:
            count = len(got) if isinstance(got, list) else "no"
            raise RuntimeError(f"vllm bench serve's result {path.name} has {count} {key} for {args.num_prompts} "
                               "requests: the lengths it sent cannot be checked")
        off = [n for n in got if abs(n - asked) > LENGTH_SLACK * asked]
        if off:
            raise RuntimeError(f"vllm bench serve's {key}: {len(off)} of {len(got)} differ from the {asked} asked "
                               f"by more than {LENGTH_SLACK:.0%} (range {min(got)}-{max(got)}): its figures are of "
                               "another workload than the other clients'")
        lengths[key] = {"min": min(got), "median": statistics.median(got), "max": max(got)}
    return {**{ours: data[theirs] for ours, theirs in VLLM_KEYS.items()}, **lengths}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def serving(session, args, url: str, tokenizer: Path) -> dict:
    """The three clients in turns; per client each figure's median and range."""
    workload = serving_workload(args)
    warm = workload.replace(num_requests=min(8, args.num_prompts), seed=99)
    vocab = session.active_model.runner.engine.vocab_size  # the in-process driver's token ids, sent over HTTP
    session.run_load(warm)
    http_ours(url, session.active, warm, vocab)
    clients = {"in process": lambda r: session.run_load(workload).summary,
               "http (ours)": lambda r: http_ours(url, session.active, workload, vocab)}
    peer_note = None
    if args.no_peer:
        peer_note = "skipped (--no-peer)"
    elif not PEER_PYTHON.exists():
        peer_note = "skipped: .venv-peers is missing (make bench-peers)"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
        clients["vllm bench"] = lambda r: vllm_bench(url, session.active, tokenizer, args, tmp, r)
    runs: dict[str, list[dict]] = {name: [] for name in clients}
    for r in range(args.repeats):
        for name, fn in clients.items():
            try:
                runs[name].append(fn(r))
            except RuntimeError as exc:
                print(f"  {name}: {exc}", flush=True)
                runs[name] = []
                clients = {k: v for k, v in clients.items() if k != name}
                break
            s = runs[name][-1]
            print(f"  round {r + 1} {name:12s} {s['output_throughput']:7.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:7.1f} "
                  f"ms  TPOT p50 {s['tpot_p50_ms']:6.1f} ms  p99 {s['tpot_p99_ms']:6.1f} ms", flush=True)
    out = {name: {**{k: spread([s[k] for s in rs]) for k in FIGURES},
                  **{k: [s[k] for s in rs] for k in ("input_lens", "output_lens") if k in rs[0]}}
           for name, rs in runs.items() if rs}
    if peer_note:
        out["vllm bench"] = peer_note
    return out


def knob_changes(session) -> dict:
    """Seconds of each kind of live change, there and back (no weight reloaded)."""
    cfg = session.active_model.config
    changes = {"max_num_seqs (scheduler)": ("max_num_seqs", max(1, cfg.max_num_seqs // 2), cfg.max_num_seqs),
               "block_size (pool)": ("block_size", 32 if cfg.block_size != 32 else 16, cfg.block_size),
               "kv_cache_memory (pool)": ("kv_cache_memory", cfg.kv_cache_memory // 2, cfg.kv_cache_memory)}
    out = {}
    for label, (field, value, back) in changes.items():
        seconds = []
        for v in (value, back, value, back):
            t = time.perf_counter()
            answer = session.reconfigure(**{field: v})
            seconds.append(time.perf_counter() - t)
            assert answer["rebuilt"] != "reload"
        out[label] = spread(seconds)
    return out


def sweep(session, args) -> dict:
    from runner_core.tuning import Lengths, Target, Workload

    workload = Workload(num_requests=args.sweep_requests, prompt_len=Lengths.uniform(32, 256),
                        output_len=Lengths.uniform(32, 128), seed=7)
    target = Target(args.target_metric, args.target_ms)
    results = args.results or str(Path(tempfile.mkdtemp(prefix="sweep-")) / "sweep.csv")
    t = time.perf_counter()
    job = session.tune(None, workload, target=target, repeats=3, warmup=1, results=results)
    last = None
    while not job.done:
        time.sleep(2)
        if job.status != last:
            last = job.status
            print(f"  {last}", flush=True)
    result = job.result()
    wall = time.perf_counter() - t
    rec = result.recommendation
    if args.chart:
        pareto_png(result, target, args.chart)
    out = {"points": len(result.points), "rows": len(result.rows), "wall_s": wall, "overhead": result.overhead,
           "timings": result.timings, "recommendation": rec, "why": result.why, "results": results,
           "frontier": [{k: p.get(k) for k in ("label", "output_throughput", "tokens_per_s_per_user")}
                        for p in result.frontier],
           "points_table": [{"label": p["label"], "output_throughput": p["median"].get("output_throughput"),
                             "output_throughput_min": p["min"].get("output_throughput"),
                             "output_throughput_max": p["max"].get("output_throughput"),
                             target.metric: p["median"].get(target.metric), "target_met": p["met"]}
                            for p in result.points]}
    if rec is not None:
        from runner_core.tuning.space import with_concurrency
        from workbench.tuning import SessionBackend

        settings = dict(rec["settings"])
        concurrency = settings.pop("concurrency", None)
        backend = SessionBackend(session)
        backend.apply({**backend.settings(), **settings})
        rerun = with_concurrency(workload, concurrency) if concurrency else workload
        values = [target.value(session.run_load(rerun.replace(seed=rerun.seed + 100 + i), target=target).summary)
                  for i in range(3)]
        margin_ms = rec["margin"] * target.limit
        out["rerun"] = {"values_ms": values, "recommended_ms": rec["value"], "margin": rec["margin"],
                        "within_margin": all(abs(v - rec["value"]) <= margin_ms for v in values),
                        "meets_target": all(v <= target.limit for v in values)}
    return out


def pareto_png(result, target, path: str) -> None:
    """The sweep's Pareto chart (workbench.views.tuning_charts.pareto) as a PNG, drawn by Debian's Chromium."""
    from playwright.sync_api import sync_playwright

    from workbench.views import tuning_charts

    fig = tuning_charts.pareto(result.points, result.frontier, result.recommendation, target)
    fig.update_layout(width=900, height=480)
    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "pareto.html"
        fig.write_html(page_file, include_plotlyjs=True, full_html=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 920, "height": 500})
            page.goto(page_file.as_uri())
            page.wait_for_selector(".main-svg")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            page.locator(".js-plotly-plot").screenshot(path=path)
            browser.close()
    print(f"# the Pareto chart: {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        run_client(args.client)
        return 0
    from runner_core.loader.model_loader import resolve_model_path
    from workbench import Session

    info = machine.machine_info("cpu")
    tag = machine.run_tag(info)
    print(f"# serving and tuning on {machine.describe(info)}", flush=True)
    session = Session()
    try:
        entry = session.load_model(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_mib << 20,
                                   max_model_len=args.max_model_len, max_num_seqs=max(16, args.concurrency))
        tokenizer = resolve_model_path(args.model)
        server = session.serve_api(port=0)
        print(f"# {entry.name} ({args.dtype}) served at {server.url}; {args.num_prompts} requests, "
              f"{args.input_len} -> {args.output_len} tokens, concurrency {args.concurrency}", flush=True)
        figures = {"machine": tag, "model": args.model, "dtype": args.dtype, "concurrency": args.concurrency,
                   "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len}
        figures["serving"] = serve = serving(session, args, server.url, tokenizer)
        base, http = serve["in process"], serve.get("http (ours)")
        if http:
            cost = 1 - http["output_throughput"]["median"] / base["output_throughput"]["median"]
            ttft = http["ttft_p50_ms"]["median"] - base["ttft_p50_ms"]["median"]
            figures["http_cost"] = {"throughput": cost, "ttft_p50_ms": ttft}
            print(f"{tag}: HTTP costs {100 * cost:.1f}% of in-process throughput (target <= 5%) and "
                  f"{ttft:+.1f} ms on TTFT p50 (target <= 5 ms) at concurrency {args.concurrency}", flush=True)
        if isinstance(serve.get("vllm bench"), dict):
            v = serve["vllm bench"]
            low, high = min(x["min"] for x in v["input_lens"]), max(x["max"] for x in v["input_lens"])
            print(f"{tag}: vllm bench serve sent prompts of {low}-{high} tokens ({args.input_len} asked) and "
                  f"measured {v['output_throughput']['median']:.1f} tok/s, TTFT p50 "
                  f"{v['ttft_p50_ms']['median']:.1f} ms, TPOT p50 {v['tpot_p50_ms']['median']:.1f} ms; in process "
                  f"{base['output_throughput']['median']:.1f} tok/s, {base['ttft_p50_ms']['median']:.1f} ms, "
                  f"{base['tpot_p50_ms']['median']:.1f} ms", flush=True)
        figures["knobs"] = knobs = knob_changes(session)
        for label, s in knobs.items():
            print(f"{tag}: {label} change {s['median']:.3f} s (range {s['min']:.3f}-{s['max']:.3f}; "
                  "target <= 1 s)", flush=True)
        if not args.no_sweep:
            figures["sweep"] = sw = sweep(session, args)
            rec = sw["recommendation"]
            print(f"{tag}: sweep of {sw['points']} points ({sw['rows']} runs) took {sw['wall_s']:.0f} s, overhead "
                  f"{100 * sw['overhead']:.1f}% (target <= 10%)", flush=True)
            for p in sw["points_table"]:
                print(f"    {p['label']:40s} {p['output_throughput']:7.1f} tok/s "
                      f"[{p['output_throughput_min']:.1f}, {p['output_throughput_max']:.1f}]  "
                      f"{args.target_metric} {p[args.target_metric]:.1f} ms  {'pass' if p['target_met'] else 'fail'}")
            if rec is not None:
                print(f"{tag}: recommended {rec.get('label')}: {rec['throughput']:.1f} tok/s, {args.target_metric} "
                      f"{rec['value']:.1f} ms, margin {100 * rec['margin']:.0f}%; ties: {len(rec.get('ties', []))}",
                      flush=True)
                rr = sw["rerun"]
                print(f"{tag}: re-run {', '.join(f'{v:.1f}' for v in rr['values_ms'])} ms: within the margin: "
                      f"{rr['within_margin']}, meets the target: {rr['meets_target']}", flush=True)
            else:
                print(f"{tag}: no recommendation: {sw['why']}", flush=True)
        server.stop()
    finally:
        session.close()
    print(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
