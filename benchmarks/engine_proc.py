"""One engine in a process of its own, started cold, then serving the driver's commands.

benchmarks/throughput.py starts this script once per engine and mode (ours with our venv's python;
vLLM with .venv-peers' python, since vLLM pins an older transformers) through
benchmarks/engine_client.py. The driver sets the cache folders (our `--compile-cache-dir`, and in the
environment TORCHINDUCTOR_CACHE_DIR and VLLM_CACHE_ROOT), so the cache state of every start is known.
Both engines get the same batch limits and prefix-caching setting, read back from the engine.

At start it writes one JSON line to the reply descriptor (`--reply-fd`):
  ready_s          wall seconds from the driver launching the process (`--launched-at`, a time.time()
                   stamp) until the engine is built and ready to serve (weights loaded, compiled)
  load_s           of those, the seconds the engine's constructor took (its imports done before):
                   weights read and placed, KV cache allocated, compiled where the mode compiles
  rss_mib          resident memory right after that, summed over this process and its children
                   (vLLM's engine core is one); ours also reports its weights, their panel
                   copies and its KV pool (memory_mib)
  first_token_s    from the launch to the first generated token of a 16-token prompt
  device, settings the device the engine runs on; max_num_seqs, max_num_batched_tokens and
                   prefix caching as the engine holds them; our compile route
Then, for each command line on stdin, one reply line:
  {"cmd": "workload"}  the requests file ([[prompt ids, max_tokens], ...]) submitted at once, greedy,
                   EOS ignored: seconds, the tokens returned (counted, not requested) and their ids
  {"cmd": "batch1"}    one request with a `--batch1-prompt` token prompt: seconds for 1 and for 129
                   output tokens; 128 / their difference is decode tok/s (prefill cancels out)
  {"cmd": "quit"}
stdout and stderr are left to the engine (vLLM logs there); the driver sends them to a log file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Run as a script, this folder is sys.path[0]: its modules (models.py, workload.py, ...) could shadow packages
# that a peer's venv has and its engine imports (tests/test_module_names.py checks only our own venv).
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]


class OursEngine:
    def __init__(self, args):
        import torch

        from runner_core import ModelRunner, SamplingParams

        torch.set_num_threads(args.threads)
        self._params = SamplingParams
        start = time.perf_counter()
        self.runner = ModelRunner({
            "model": args.model, "dtype": args.dtype, "device": args.device, "compile": args.compile,
            "compile_fallback": False, "compile_cache_dir": args.compile_cache_dir,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.prefix_caching, "max_model_len": args.max_model_len,
            "kv_cache_memory": args.kv_cache_gib and args.kv_cache_gib << 30}).load_model()
        self.load_s = time.perf_counter() - start

    def generate(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        return [o.token_ids for o in self.runner.generate([ids for ids, _ in requests], params)]

    def describe(self) -> dict:
        import runner_core
        config = self.runner.config
        stats = self.runner.compile_stats() if config.compile else {}
        return {"device": str(config.torch_device), "version": getattr(runner_core, "__version__", "?"),
                "settings": {"max_num_seqs": config.max_num_seqs,
                             "max_num_batched_tokens": config.effective_max_num_batched_tokens,
                             "prefix_caching": config.enable_prefix_caching},
                "compile_route": stats.get("warm_start"),
                "memory_mib": {k.removesuffix("_bytes"): round(v / 2**20, 1)
                               for k, v in self.runner.memory_stats().items()
                               if k in ("weights_bytes", "panel_weights_bytes", "kv_pool_bytes")}}


class VllmEngine:
    def __init__(self, args):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib or 2)  # GiB
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self._params, self._prompt = SamplingParams, TokensPrompt
        start = time.perf_counter()
        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       skip_tokenizer_init=True, seed=0, enforce_eager=not args.compile,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=args.prefix_caching)
        self.load_s = time.perf_counter() - start

    def generate(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        prompts = [self._prompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                  for _, n in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def describe(self) -> dict:
        import vllm
        from vllm.platforms import current_platform
        config = self.llm.llm_engine.vllm_config
        mode = config.compilation_config.mode
        return {"device": current_platform.device_type, "version": vllm.__version__,
                "settings": {"max_num_seqs": config.scheduler_config.max_num_seqs,
                             "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                             "prefix_caching": bool(config.cache_config.enable_prefix_caching)},
                "compile_route": None if config.model_config.enforce_eager
                else f"torch.compile, {getattr(mode, 'name', mode)}"}


ENGINES = {"ours": OursEngine, "vllm": VllmEngine}


def tree_rss_mib(pid: int) -> float:
    """Resident memory (VmRSS) of process `pid` and all its descendants, in MiB (pages shared between
    them are counted in each)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += parents.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += int(status.split("VmRSS:", 1)[1].split()[0]) if "VmRSS:" in status else 0
    return total / 1024


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def serve(engine, requests, args, reply) -> None:
    prompt = [7 + i % 100 for i in range(args.batch1_prompt)]
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "workload":
            seconds, tokens = _timed(lambda: engine.generate(requests))
            reply({"seconds": seconds, "returned_tokens": sum(map(len, tokens)), "tokens": tokens})
        elif cmd == "batch1":
            one, _ = _timed(lambda: engine.generate([(prompt, 1)]))
            many, out = _timed(lambda: engine.generate([(prompt, 129)]))
            reply({"one_s": one, "many_s": many, "returned_tokens": len(out[0])})
        elif cmd == "quit":
            return
        else:
            reply({"error": f"unknown command {cmd!r}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=list(ENGINES), required=True)
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="ours: the runner's device (vLLM runs where its build does)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-cache-dir", default="./compile_cache", help="ours: the compile cache folder")
    ap.add_argument("--requests", required=True, help="a JSON file: [[prompt ids, max_tokens], ...]")
    ap.add_argument("--launched-at", type=float, default=None, help="time.time() when the driver started us")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--kv-cache-gib", type=int, default=None,
                    help="the KV cache in GiB (default: ours sizes its own pool; vLLM 2 GiB)")
    ap.add_argument("--batch1-prompt", type=int, default=32)
    ap.add_argument("--reply-fd", type=int, required=True, help="the descriptor the JSON replies go to")
    args = ap.parse_args()
    launched = args.launched_at or time.time()
    with open(args.requests) as f:
        requests = [(list(ids), int(n)) for ids, n in json.load(f)]
    out = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    engine = ENGINES[args.engine](args)
    ready_s = time.time() - launched
    rss_mib = tree_rss_mib(os.getpid())
    engine.generate([([5] * 16, 1)])
    first_token_s = time.time() - launched
    reply({"ready_s": ready_s, "first_token_s": first_token_s, "load_s": engine.load_s, "rss_mib": rss_mib,
           **engine.describe()})
    serve(engine, requests, args, reply)


if __name__ == "__main__":
    main()
