"""One engine in a process of its own, from cold: load, first token, the workload, batch-1 decode.

benchmarks/throughput.py starts this script once per engine and dtype (ours with our venv's
python; vLLM with .venv-peers' python, since vLLM pins an older transformers), so every engine
starts cold, runs alone on the machine and is measured the same way:

  first_token_s    wall seconds from the driver launching the process (`--launched-at`, a
                   time.time() stamp) to the first generated token of a 16-token prompt
  seconds          the workload (the requests file: [[prompt ids, max_tokens], ...]) submitted at
                   once, greedy, EOS ignored; fastest of `--repeats` runs after one warm-up
  batch1_decode_tok_s  one request, `--batch1-prompt` token prompt: 128 / (seconds for 129 output
                   tokens - seconds for 1), so prefill and start-up cancel out; fastest of `--repeats`

They go to the `--out` file as one JSON object, with the workload's output token ids (stdout is
left to the engine: vLLM logs there).
"""

from __future__ import annotations

import argparse
import json
import os
import time


class OursEngine:
    def __init__(self, args):
        import torch

        from runner_core import ModelRunner, SamplingParams

        torch.set_num_threads(args.threads)
        self._params = SamplingParams
        self.runner = ModelRunner({"model": args.model, "dtype": args.dtype, "compile": args.compile,
                                   "max_num_seqs": 64, "max_model_len": args.max_model_len}).load_model()

    def generate(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        return [o.token_ids for o in self.runner.generate([ids for ids, _ in requests], params)]


class VllmEngine:
    def __init__(self, args):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the workload needs far less
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self._params, self._prompt = SamplingParams, TokensPrompt
        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       skip_tokenizer_init=True, seed=0, enforce_eager=not args.compile)

    def generate(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        prompts = [self._prompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                  for _, n in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


ENGINES = {"ours": OursEngine, "vllm": VllmEngine}


def _fastest(repeats: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=list(ENGINES), required=True)
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--requests", required=True, help="a JSON file: [[prompt ids, max_tokens], ...]")
    ap.add_argument("--launched-at", type=float, default=None, help="time.time() when the driver started us")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch1-prompt", type=int, default=32)
    ap.add_argument("--out", required=True, help="where the JSON figures go")
    args = ap.parse_args()
    launched = args.launched_at or time.time()
    with open(args.requests) as f:
        requests = [(list(ids), int(n)) for ids, n in json.load(f)]

    t = time.perf_counter()
    engine = ENGINES[args.engine](args)
    load_s = time.perf_counter() - t
    engine.generate([([5] * 16, 1)])
    first_token_s = time.time() - launched
    engine.generate([([5] * 16, 4)])  # warm-up
    seconds, tokens = _fastest(args.repeats, lambda: engine.generate(requests))
    prompt = [7 + i % 100 for i in range(args.batch1_prompt)]
    one, _ = _fastest(args.repeats, lambda: engine.generate([(prompt, 1)]))
    many, _ = _fastest(args.repeats, lambda: engine.generate([(prompt, 129)]))
    with open(args.out, "w") as f:
        json.dump({"engine": args.engine, "dtype": args.dtype, "compile": args.compile, "load_s": load_s,
                   "first_token_s": first_token_s, "seconds": seconds,
                   "batch1_decode_tok_s": 128 / max(many - one, 1e-9), "tokens": tokens}, f)


if __name__ == "__main__":
    main()
