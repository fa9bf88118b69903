"""Weight storage formats side by side: memory, speed and quality per model and format, llama.cpp beside.

For each `--model` (default small-llama, qwen2.5-0.5b, llama-3.2-1b) and format (benchmarks/quant_proc.py
FORMATS: none = float32, the reference; bf16; int8; int4 in groups of 32/64/128; int8 and int4 g64 with the
LM head quantized too), each in a fresh process of its own (quant_proc.py; quantized formats compute in
`--quant-dtype`, float32 by default):
  memory    load seconds, peak resident memory during the load (VmHWM), resident after it, the stored weight
            bytes (model_info()["quantization"]["weights_bytes"]), the KV pool (256 MiB asked of every run)
  quality   against the float32 reference on 4 fixed 32-token prompts: max and mean |logit error|, and the
            share of its greedy next tokens (32 per prompt) each format picks too, fed the same tokens
  speed     batch-1 decode tok/s (32-token prompt, 128 tokens; the 1-token call's time subtracted) and the
            GB/s of weight bytes that reads (bytes one step reads x tok/s) against the memory bandwidth probed
            in the same round (benchmarks/machine.py, the sum probe); the mixed workload of
            benchmarks/workload.py (24 requests, prompts 16-256, outputs 16-128, all at once; `--mixed-formats`,
            default none, bf16, int8, int4-g64): useful tok/s
  peers     llama.cpp (`make bench-llamacpp-peer`; benchmarks/llamacpp_peer.py) on GGUF files written from
            the same safetensors in F32, Q8_0 and Q4_0: the same memory, quality and batch-1 figures
Timed figures: `--repeats` rounds (>= 3), in each of which every format and peer takes one turn, the order
rotated a place each round (A B C, B C A, C A B: `turn_order`); the median and range over the rounds. The
formats are compared turn by turn, never one format's rounds after another's: on a shared machine the
bandwidth swung 4-68 GB/s within one run, and formats measured minutes apart compared the machine's moods.
A model whose float32 weights fit in 1 GiB keeps every process alive through the rounds (one untimed turn
each first; one bandwidth probe a round). A larger one (qwen2.5-0.5b, llama-3.2-1b; eight processes at 2-3
GiB each do not fit beside llama.cpp in 24 GiB) has one process alive at a time unless `--interleave`: each
turn starts its format's process (memory and quality measured at its first start only), gives it an
untimed turn, probes the bandwidth, times it and closes it. Then the perplexity of the trained tiny-speaker
per format on held-out prose (runner_tools.quality: the standard library's test folders, which its corpus
leaves out). Every figure names the CPU and kernel tier; the targets set for the formats are reported, never
enforced, and the speed targets are refused when the machine was not quiet at the start (its 1-minute load
average against its cores: benchmarks/verdicts.py); the last stdout line is one JSON object.

Run:  make bench-quant   or   .venv/bin/python benchmarks/quant.py [--model small-llama] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

from runner_core.loader.model_loader import read_hf_config, resolve_model_path

try:  # run as a script: benchmarks/ is on sys.path
    import child
    import llamacpp_peer
    import machine
    import quant_proc
    import quant_report
    import verdicts
    import workload
except ImportError:  # run as `python -m benchmarks.quant`
    from benchmarks import child, llamacpp_peer, machine, quant_proc, quant_report, verdicts, workload

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("small-llama", "qwen2.5-0.5b", "llama-3.2-1b")
ONE_AT_A_TIME_BYTES = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help=f"a preset or model directory (repeatable; default {MODELS})")
    ap.add_argument("--formats", nargs="+", choices=list(quant_proc.FORMATS), default=list(quant_proc.FORMATS))
    ap.add_argument("--quant-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the compute dtype of the int8/int4 runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--mixed-requests", type=int, default=24)
    ap.add_argument("--mixed-formats", nargs="+", choices=list(quant_proc.FORMATS),
                    default=["none", "bf16", "int8", "int4-g64"], help="the formats that run the mixed workload")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--interleave", action="store_true", help="keep every format alive even for large models")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out even when its venv exists")
    ap.add_argument("--ppl-paragraphs", type=int, default=400, help="held-out paragraphs for tiny-speaker")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a process may take to load or reply")
    ap.add_argument("--quick", action="store_true", help="small-llama, none/int8/int4-g64, 2 rounds, short runs")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: run at least one round (3 or more for a median with a range)")
    if args.quick:
        args.model = args.model or ["small-llama"]
        if args.formats == list(quant_proc.FORMATS):
            args.formats = ["none", "int8", "int4-g64"]
        args.repeats, args.decode_tokens, args.mixed_requests = min(args.repeats, 2), 16, 4
        args.ppl_paragraphs = 60
    args.model = args.model or list(MODELS)
    args.formats = ["none", *[f for f in args.formats if f != "none"]]  # the reference first
    return args


def compute_dtype(fmt: str, args) -> str:
    return {"none": "float32", "bf16": "bfloat16"}.get(fmt, args.quant_dtype)


def start_ours(fmt: str, model_dir: str, tmp: Path, args, errors: dict, quality: bool = True) -> child.Child | None:
    """`fmt`'s process (None when it failed: the error in `errors`); `quality` False: no quality check (a
    restart, measured at the first start)."""
    ref = tmp / "ref.npz"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quant_proc.py"), "--model", model_dir, "--format", fmt,
           "--dtype", compute_dtype(fmt, args), "--threads", str(args.threads), "--requests", str(tmp / "mixed.json"),
           "--decode-tokens", str(args.decode_tokens), "--write-ref" if fmt == "none" else "--ref", str(ref),
           *([] if quality else ["--skip-quality"])]
    print(f"  loading {fmt} in a new process ...", flush=True)
    try:
        return child.Child(fmt, cmd, tmp / f"{fmt}.log", args.timeout)
    except child.ChildFailed as e:
        errors[fmt] = str(e)
        print(f"  {e}")
        return None


def start_peer(model_dir: str, gtype: str, tmp: Path, args, errors: dict) -> child.Child | None:
    name = f"llama.cpp {gtype}"
    print(f"  loading {name} in a new process ...", flush=True)
    try:
        return llamacpp_peer.start(model_dir, gtype, tmp, args)
    except child.ChildFailed as e:
        errors[name] = str(e)
        print(f"  {e}")
        return None


def start_process(name: str, model_dir: str, tmp: Path, args, errors: dict, quality: bool = True):
    """A format's process (start_ours) or a peer's ("llama.cpp <type>": start_peer)."""
    if name.startswith("llama.cpp "):
        return start_peer(model_dir, name.split(" ", 1)[1], tmp, args, errors)
    return start_ours(name, model_dir, tmp, args, errors, quality)


def turn_order(names: list[str], repeats: int) -> list[list[str]]:
    """Each round's turns: every name once, the order rotated a place each round (A B C, B C A, C A B, ...),
    so that a swing of the machine's speed falls on every format alike and none always goes first."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(repeats)] if names else []


def run_rounds(procs: dict, args, errors: dict, probes: list, starters: dict | None = None) -> dict:
    """`args.repeats` rounds of turns (`turn_order`) over the processes in `procs`, alive throughout (one
    untimed turn each first, a bandwidth probe at each round's start), and those `starters` start ({name:
    a function returning the process or None}: each turn starts one, gives it an untimed turn, probes the
    bandwidth, times it and closes it). A turn: batch-1, then the mixed workload for `args.mixed_formats`.
    {name: {"batch1": [tok/s], "mixed": [tok/s], "bandwidth": [GB/s of the probe before the turn]}}."""
    starters = starters or {}
    mixed, decode_tokens, live = set(args.mixed_formats), args.decode_tokens, dict(procs)
    timings = {name: {"batch1": [], "mixed": [], "bandwidth": []} for name in [*procs, *starters]}

    def ask(name: str, cmd: str) -> dict | None:
        if name in errors:
            return None
        try:
            return live[name].ask(cmd)
        except child.ChildFailed as e:
            errors[name] = str(e)
            print(f"  {e}")
            return None

    def untimed(name: str) -> None:
        ask(name, "batch1")
        if name in mixed:
            ask(name, "mixed")

    for name in procs:
        untimed(name)
    for r, order in enumerate(turn_order(list(timings), args.repeats)):
        print(f"  round {r + 1}/{args.repeats}: {', '.join(order)}", flush=True)
        probe = None
        for name in order:
            if name in starters and name not in errors:
                live[name] = starters[name]()
            if name in errors or live.get(name) is None:
                continue
            try:
                if name in starters:
                    untimed(name)
                if probe is None or name in starters:
                    probe = machine.bandwidth_probes("cpu", calls=3)
                    probes.append(probe)
                res = ask(name, "batch1")
                if res and res["many_s"] > res["one_s"]:
                    timings[name]["batch1"].append(decode_tokens / (res["many_s"] - res["one_s"]))
                    timings[name]["bandwidth"].append(probe["sum"]["median"])
                if name in mixed and (res := ask(name, "mixed")):
                    timings[name]["mixed"].append(res["returned_tokens"] / res["seconds"])
            finally:
                if name in starters:
                    live.pop(name).close()
    return timings


def run_model(model: str, args, errors: dict) -> dict:
    model_dir = str(resolve_model_path(model))
    vocab = read_hf_config(Path(model_dir)).get_text_config().vocab_size
    print(f"{model} ({model_dir})", flush=True)
    with tempfile.TemporaryDirectory(prefix="quant-bench-") as tmp_name:
        tmp = Path(tmp_name)
        reqs = workload.make_workload(args.mixed_requests, seed=0, vocab_size=vocab, output_len=(16, 128))
        (tmp / "mixed.json").write_text(json.dumps([[r.prompt_ids, r.max_tokens] for r in reqs]))
        starts, timings, probes, alive, starters = {}, {}, [], {}, {}
        peers = () if args.no_llamacpp or not llamacpp_peer.available() else llamacpp_peer.TYPES
        names = [*args.formats, *(f"llama.cpp {g}" for g in peers)]

        def start(name: str) -> child.Child | None:  # a turn's own process; its first start's figures count
            proc = start_process(name, model_dir, tmp, args, errors, quality=name not in starts)
            if proc is not None:
                starts.setdefault(name, proc.started)
            return proc

        ref = start("none")  # first: it writes the reference the others' quality is measured against
        try:
            if ref is not None and starts["none"]["dense_bytes"] > ONE_AT_A_TIME_BYTES and not args.interleave:
                ref.close()
                starters = {name: functools.partial(start, name) for name in names}
            elif ref is not None:
                alive["none"] = ref
                alive.update((name, p) for name in names[1:] if (p := start(name)) is not None)
            timings = run_rounds(alive, args, errors, probes, starters)
        finally:
            for p in alive.values():
                p.close()
    return {"model_dir": model_dir, "starts": starts, "timings": timings,
            "bandwidth": machine.pool_probes(probes) if probes else None}


def tiny_speaker_perplexity(args, errors: dict) -> dict:
    """Each format's perplexity of tiny-speaker on held-out prose (this process; a 1M-parameter model)."""
    import torch

    from runner_core import ModelRunner
    from runner_tools.quality import held_out_paragraphs, perplexity, token_windows

    torch.set_num_threads(args.threads)
    texts = held_out_paragraphs(args.ppl_paragraphs)
    out = {}
    for fmt in args.formats:
        config = {"model": "tiny-speaker", "dtype": compute_dtype(fmt, args), **quant_proc.FORMATS[fmt]}
        try:
            runner = ModelRunner(config).load_model()
        except Exception as e:  # noqa: BLE001 - reported beside the others
            errors[f"tiny-speaker {fmt}"] = f"{type(e).__name__}: {e}"
            continue
        windows = token_windows(runner.tokenizer.hf, texts)
        out[fmt] = {"perplexity": perplexity(lambda ids, r=runner: r.forward(ids)["logits"], windows),
                    "tokens": windows.numel()}
        runner.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet = verdicts.quiet_at_start()  # before this benchmark runs anything of its own
    info = machine.machine_info("cpu")
    print(machine.describe(info), flush=True)
    print(f"load average at the start: {quiet.load:.2f} on {quiet.cores} cores (quiet up to {quiet.limit:.2f}: "
          f"{'quiet' if quiet.ok else 'NOT quiet, speed verdicts refused'})", flush=True)
    errors: dict[str, str] = {}
    results = {"machine": info, "tag": machine.run_tag(info), "args": {k: v for k, v in vars(args).items()},
               "quiet": quiet, "models": {}, "errors": errors}
    for model in args.model:
        model_errors: dict[str, str] = {}
        results["models"][model] = run_model(model, args, model_errors)
        errors.update({f"{model} {k}": v for k, v in model_errors.items()})
    print("tiny-speaker perplexity on held-out prose ...", flush=True)
    results["perplexity"] = tiny_speaker_perplexity(args, errors)
    summary = quant_report.report(results)
    starts = {model: figures["starts"] for model, figures in results["models"].items()}
    print(json.dumps({**{k: results[k] for k in ("tag", "machine", "args", "errors")}, "starts": starts,
                      "quiet_at_start": quiet.as_dict(), **summary}, default=str))


if __name__ == "__main__":
    main()
