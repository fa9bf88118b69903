"""Command line: `python -m runner_core generate --model tiny-llama --prompt "..."`, and
`python -m runner_core tune --model small-llama` (a sweep under a latency target: runner_core/tuning/cli.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from runner_core import ModelRunner, RunnerError, SamplingParams
from runner_core.tuning import cli as tuning_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runner_core", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", required=True, help="local Hugging Face directory or preset (tiny-llama, small-llama)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="ranks splitting each layer (spawned here, or the ranks of torchrun)")
    gen.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    tuning_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "tune":
        try:
            return tuning_cli.run(args)
        except (RunnerError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        runner = ModelRunner(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                             tensor_parallel_size=args.tensor_parallel_size,
                             pipeline_parallel_size=args.pipeline_parallel_size)
        runner.load_model()  # under torchrun, ranks > 0 serve rank 0 in here and exit with it
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        if args.stream:
            for delta in runner.stream(args.prompt[0], params):
                print(delta.text, end="", flush=True)
            print()
            return 0
        for prompt, out in zip(args.prompt, runner.generate(args.prompt, params)):
            if args.json:
                print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                                  "finish_reason": out.finish_reason, "error": out.error, "metrics": out.metrics}))
            else:
                print(f"--- {prompt!r} -> ({out.finish_reason}, {len(out.token_ids)} tokens, "
                      f"{(out.metrics.get('tokens_per_s') or 0):.1f} tok/s)\n"
                      f"{out.text if out.error is None else out.error}")
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if "runner" in locals():
            runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
