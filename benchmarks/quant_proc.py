"""One model in one weight format, loaded in a process of its own, then serving benchmarks/quant.py's commands.

At start it loads the model (peak resident memory of the load: VmHWM, reset just before it through
/proc/self/clear_refs), measures its quality against the float32 reference (`--write-ref` makes that
reference: the fixed prompts' logits and greedy continuations, as an .npz that llama.cpp's side reads too),
and writes one JSON line to `--reply-fd`:
  load_s, peak_rss_mib, rss_mib     the load's seconds and memory (resident after it)
  weights_bytes, dense_bytes        what the weights hold now / would hold in the compute dtype
  read_bytes                        weight bytes one decode step reads: all but the input embedding's
                                    rows (it reads one row a token) unless the LM head is that same tensor
  kv_pool_bytes, quantization       the KV pool; model_info()["quantization"]
  logit_error, agreement            runner_tools.quality against the reference (absent for the reference,
                                    and with --skip-quality)
Then for each command line on stdin one reply line:
  {"cmd": "batch1"}   one request with a 32-token prompt: seconds for 1 and for 1 + `--decode-tokens`
                      tokens (their difference is the decode time: prefill cancels out)
  {"cmd": "mixed"}    the mixed workload (`--requests`, a JSON file [[prompt ids, max_tokens], ...]) at once:
                      seconds and the tokens returned
  {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

FORMATS = {  # name -> the RunnerConfig fields it sets (beside the compute dtype)
    "none": {}, "bf16": {},
    "int8": {"quantization": "int8"},
    "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
    "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4-g128": {"quantization": "int4", "quantization_group_size": 128},
    "int8+head": {"quantization": "int8", "quantize_lm_head": True},
    "int4-g64+head": {"quantization": "int4", "quantization_group_size": 64, "quantize_lm_head": True},
}
BATCH1_PROMPT = 32


def status_kib(field: str) -> int:
    """A VmRSS / VmHWM figure of this process from /proc/self/status, in KiB."""
    return int(Path("/proc/self/status").read_text().split(f"{field}:", 1)[1].split()[0])


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux: 5 written to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then the peak is the process's since start, imports included


def decode_read_bytes(model, weights_bytes: int) -> int:
    """`weights_bytes` less the input embedding's own storage when the LM head does not share it."""
    named = dict(model.named_modules())
    emb = [m for n, m in named.items() if n.endswith("embed_tokens")]
    head = [m for n, m in named.items() if n.endswith("lm_head")]
    head_ptrs = {t.untyped_storage().data_ptr() for m in head for t in (*m.parameters(), *m.buffers())}
    unread = sum(t.nbytes for m in emb for t in (*m.parameters(), *m.buffers())
                 if t.untyped_storage().data_ptr() not in head_ptrs)
    return weights_bytes - unread


def prompt_set(vocab: int, prompts: int, length: int) -> list[list[int]]:
    """Fixed pseudo-random prompts (ids 3..vocab-1), the same in every process."""
    import random
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(prompts)]


def quality(runner, args) -> dict:
    import numpy as np
    import torch

    from runner_core import SamplingParams
    from runner_tools.quality import greedy_agreement, logit_error

    def forward(ids):
        return runner.forward(ids)["logits"]

    if args.write_ref:
        prompts = prompt_set(runner.engine.vocab_size, args.prompts, args.prompt_len)
        params = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in runner.generate(prompts, params)]
        logits = forward(torch.tensor(prompts)).float().numpy()
        np.savez(args.write_ref, prompts=np.array(prompts), logits=logits, tokens=np.array(tokens))
        return {}
    ref = np.load(args.ref)
    prompts, tokens = ref["prompts"].tolist(), ref["tokens"].tolist()
    logits = forward(torch.tensor(prompts))
    return {"logit_error": logit_error(logits, torch.from_numpy(ref["logits"])),
            "agreement": greedy_agreement(forward, prompts, tokens)}


def load(args) -> tuple[object, dict]:
    import torch

    from runner_core import ModelRunner

    torch.set_num_threads(args.threads)
    config = {"model": args.model, "dtype": args.dtype, "max_model_len": 512, "kv_cache_memory": args.kv_mib << 20,
              "max_num_seqs": 64, "cpu_threads": args.threads, **FORMATS[args.format]}
    reset_peak()
    start = time.perf_counter()
    runner = ModelRunner(config).load_model()
    load_s = time.perf_counter() - start
    figures = {"load_s": load_s, "peak_rss_mib": status_kib("VmHWM") / 1024, "rss_mib": status_kib("VmRSS") / 1024}
    stats, info = runner.memory_stats(), runner.model_info()
    quant = info.get("quantization") or {}
    weights = quant.get("weights_bytes", stats["weights_bytes"] + stats.get("panel_weights_bytes", 0))
    figures.update(weights_bytes=weights, dense_bytes=quant.get("dense_bytes", stats["weights_bytes"]),
                   read_bytes=decode_read_bytes(runner.model, weights), kv_pool_bytes=stats["kv_pool_bytes"],
                   quantization=quant or None, dtype=info["dtype"])
    return runner, figures


def serve(runner, args, reply) -> None:
    from runner_core import SamplingParams

    def run(requests) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        t = time.perf_counter()
        outs = runner.generate([ids for ids, _ in requests], params)
        return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)

    with open(args.requests) as f:
        mixed = [(list(ids), int(n)) for ids, n in json.load(f)]
    prompt = [7 + i % 100 for i in range(BATCH1_PROMPT)]
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "batch1":
            one, _ = run([(prompt, 1)])
            many, returned = run([(prompt, 1 + args.decode_tokens)])
            reply({"one_s": one, "many_s": many, "returned_tokens": returned})
        elif cmd == "mixed":
            seconds, returned = run(mixed)
            reply({"seconds": seconds, "returned_tokens": returned})
        elif cmd == "quit":
            return
        else:
            reply({"error": f"unknown command {cmd!r}"})


def main() -> None:
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # this folder's modules could shadow packages a peer's engine imports
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", choices=list(FORMATS), required=True)
    ap.add_argument("--dtype", default="float32", help="the compute dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--write-ref", help="write the reference .npz here (the float32 run)")
    ap.add_argument("--ref", help="the reference .npz to measure quality against")
    ap.add_argument("--skip-quality", action="store_true", help="no quality check (nor reference written): a "
                    "restart of a format measured before")
    ap.add_argument("--reply-fd", type=int, required=True)
    args = ap.parse_args()
    out = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        runner, figures = load(args)
        if not args.skip_quality:
            figures.update(quality(runner, args))
    except Exception as e:  # the driver shows why this format did not run, and goes on with the others
        reply({"error": f"{type(e).__name__}: {e}"})
        raise
    reply(figures)
    serve(runner, args, reply)


if __name__ == "__main__":
    main()
