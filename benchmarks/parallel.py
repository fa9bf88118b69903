"""Tensor and pipeline parallelism on this CPU: step time, throughput and the communication per step.

Layouts (spawned ranks over gloo, one machine): TP=1 (one process, all threads), TP=2 and PP=2
(two processes, the threads split between them), optionally TP=2 x PP=2 (--hybrid).
Workload: `--requests` prompts of `--prompt-len` random token ids (fixed seed), greedy,
`--max-tokens` each, EOS ignored; every layout must produce the same tokens as TP=1.

Per layout: the mean time of a prefill step and of a pure decode step (rank 0's step records),
useful output tok/s, and rank 0's communication per decode step from its counters: calls and
bytes of all-reduce / all-gather / send / recv and the seconds spent in them (including waiting
for the slower rank), plus the command broadcasts. On 2 cores expect little or no speed-up:
the ranks share the cores, and a decode step of a small model is short next to the ~0.1 ms of a
loopback gloo collective. The last stdout line is one JSON object with the figures.

Run:  .venv/bin/python benchmarks/parallel.py [--model small-llama] [--hybrid] [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.distributed.parallel_state import COMM_STATS

LAYOUTS = {"tp1": (1, 1), "tp1-1thread": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}


# ---- pure transport: what a collective costs between two idle processes ------------------------
def _transport_rank(rank: int, port: int, sizes: list[int], iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for n in sizes:
        x = torch.ones(n // 4)
        for name in ("all_reduce", "send_recv"):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                if name == "all_reduce":
                    dist.all_reduce(x)
                elif rank == 0:
                    dist.send(x, 1)
                else:
                    dist.recv(x, 0)
            results[f"{name}_{n}"] = 1e6 * (time.perf_counter() - t) / iters
    payload = [(i, 1, [5], list(range(8)), True) for i in range(16)]  # a decode step of 16 sequences
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        box = [("step", payload)] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
    results["broadcast_step_16seqs"] = 1e6 * (time.perf_counter() - t) / iters
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def transport(sizes: list[int], iters: int = 200) -> dict:
    """Microseconds per collective for each message size (bytes), gloo over loopback."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_transport_rank, args=(r, port, sizes, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=300)
    for p in procs:
        p.join()
    return {k: round(v, 1) for k, v in results.items()}


def workload(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_layout(name: str, args, prompts) -> dict:
    tp, pp = LAYOUTS[name]
    threads = torch.get_num_threads()
    if name == "tp1-1thread":
        torch.set_num_threads(1)
    try:
        return _run_layout(name, tp, pp, args, prompts)
    finally:
        torch.set_num_threads(threads)


def _run_layout(name: str, tp: int, pp: int, args, prompts) -> dict:
    t0 = time.perf_counter()
    runner = ModelRunner(model=args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
                         pipeline_parallel_size=pp, max_model_len=args.prompt_len + args.max_tokens,
                         max_num_seqs=args.requests).load_model()
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        runner.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        runner.engine.step_metrics.clear()
        COMM_STATS.reset()
        decode_comm = {"calls": {}, "bytes": {}, "seconds": {}}
        t0 = time.perf_counter()
        ids = [runner.add_request(p, params) for p in prompts]
        done = {}
        while runner.has_unfinished_requests():
            before = COMM_STATS.as_dict()
            for out in runner.step():
                if out.finished:
                    done[out.request_id] = out
            last = runner.step_metrics[-1] if runner.step_metrics else None
            if last is not None and last.num_prefill_tokens == 0:  # a pure decode step: its communication
                after = COMM_STATS.as_dict()
                for key in ("calls", "bytes", "seconds"):
                    for kind, value in after[key].items():
                        decode_comm[key][kind] = decode_comm[key].get(kind, 0) + value - before[key][kind]
        wall = time.perf_counter() - t0
        outs = [done[i] for i in ids]
        steps = list(runner.step_metrics)
        info = runner.parallel_info()
    finally:
        runner.shutdown()
    decode = [m for m in steps if m.num_prefill_tokens == 0]
    prefill = [m for m in steps if m.num_prefill_tokens > 0]
    n_dec = max(1, len(decode))
    per_step = {k: {"calls": decode_comm["calls"][k] / n_dec, "bytes": decode_comm["bytes"][k] / n_dec,
                    "ms": 1e3 * decode_comm["seconds"][k] / n_dec}
                for k in decode_comm["calls"] if decode_comm["calls"][k]}
    comm_ms_decode = 1e3 * sum(decode_comm["seconds"].values()) / n_dec
    out_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "layout": name, "tp": tp, "pp": pp, "load_s": round(load_s, 2), "wall_s": round(wall, 3),
        "steps": len(steps), "decode_steps": len(decode), "prefill_steps": len(prefill),
        "decode_step_ms": round(1e3 * sum(m.total_s for m in decode) / n_dec, 2),
        "prefill_step_ms": round(1e3 * sum(m.total_s for m in prefill) / max(1, len(prefill)), 2),
        "decode_forward_ms": round(1e3 * sum(m.forward_s for m in decode) / n_dec, 2),
        "decode_prepare_ms": round(1e3 * sum(m.prepare_s for m in decode) / n_dec, 2),
        "comm_ms_per_decode_step": round(comm_ms_decode, 2) if info else 0.0,
        "comm_per_step": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in per_step.items()} if info else {},
        "output_tok_s": round(out_tokens / wall, 1),
        "threads_per_rank": max(1, torch.get_num_threads() // (tp * pp)),
        "load_average": round(os.getloadavg()[0], 2),
        "tokens": [o.token_ids for o in outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (gloo), or cuda for the multi-GPU figures (NCCL)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hybrid", action="store_true", help="also TP=2 x PP=2 (four processes)")
    parser.add_argument("--quick", action="store_true", help="8 requests of 64 tokens, 16 outputs")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens = 8, 64, 16
    torch.set_num_threads(args.threads)
    from runner_core.loader.model_loader import read_hf_config, resolve_model_path

    vocab = read_hf_config(resolve_model_path(args.model)).vocab_size
    prompts = workload(args.requests, args.prompt_len, vocab)
    names = ["tp1", "tp1-1thread", "tp2", "pp2"] + (["tp2xpp2"] if args.hybrid else [])
    results = [run_layout(n, args, prompts) for n in names]
    hidden = read_hf_config(resolve_model_path(args.model)).hidden_size
    # a decode step's all-reduce ([seqs, hidden] fp32) and a prefill chunk's (512 tokens)
    sizes = [args.requests * hidden * 4, 512 * hidden * 4]
    wire = transport(sizes)
    reference = results[0].pop("tokens")
    for r in results[1:]:
        r["same_tokens_as_tp1"] = r.pop("tokens") == reference
    print(f"{args.model}, {args.requests} requests x ({args.prompt_len} prompt + {args.max_tokens} output) tokens, "
          f"{args.dtype} on {args.device}, {os.cpu_count()} CPUs, {args.threads} threads shared by the ranks, "
          f"load average {os.getloadavg()[0]:.1f}")
    head = f"{'layout':<9}{'tok/s':>8}{'decode ms':>11}{'prefill ms':>12}{'comm ms/dec':>13}{'  same':>7}"
    print(head)
    for r in results:
        print(f"{r['layout']:<9}{r['output_tok_s']:>8}{r['decode_step_ms']:>11}{r['prefill_step_ms']:>12}"
              f"{r['comm_ms_per_decode_step']:>13}{str(r.get('same_tokens_as_tp1', '-')):>7}")
    for r in (r for r in results if r["comm_per_step"]):
        parts = ", ".join(f"{k} {v['calls']:.0f} x {v['bytes'] / max(1, v['calls']) / 1024:.1f} KiB ({v['ms']:.2f} ms)"
                          for k, v in r["comm_per_step"].items())
        print(f"  {r['layout']} per decode step: {parts}")
    print("pure transport, gloo on loopback between two idle processes (microseconds per call): "
          + ", ".join(f"{k} {v}" for k, v in wire.items()))
    tp2 = next(r for r in results if r["layout"] == "tp2")
    calls = tp2["comm_per_step"].get("all_reduce", {}).get("calls", 0)
    floor_ms = calls * wire[f"all_reduce_{sizes[0]}"] / 1e3 + wire["broadcast_step_16seqs"] / 1e3
    print(f"  TP=2 decode step: {calls:.0f} all-reduces of {sizes[0] / 1024:.1f} KiB + the step broadcast = "
          f"{floor_ms:.2f} ms of pure transport; the rest of 'comm ms' is waiting for the other rank")
    base = results[0]["output_tok_s"]
    print(json.dumps({"benchmark": "parallel", "model": args.model, "requests": args.requests,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
                      "layouts": results, "transport_us": wire, "tp2_decode_transport_ms": round(floor_ms, 3),
                      "speedup_vs_tp1": {r["layout"]: round(r["output_tok_s"] / base, 2)
                                                             for r in results[1:]}}))


if __name__ == "__main__":
    main()
