"""Fixed-seed synthetic workloads shared by the benchmarks, running one on a ModelRunner, and the
step overhead of a pure-decode batch (`decode_overhead`).

A request is a list of prompt token ids (random ids, no text) and the exact number of tokens it
must produce (EOS is ignored), so every method does the same useful work and the same seed gives
the same requests on every machine and every run.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int  # exact output length: generation ignores EOS

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def make_workload(num_requests: int = 64, *, seed: int = 0, vocab_size: int = 8192,
                  prompt_len: tuple[int, int] = (16, 256), output_len: tuple[int, int] = (16, 128),
                  min_token_id: int = 3) -> list[Request]:
    """`num_requests` requests with prompt and output lengths uniform in the inclusive ranges
    given, prompt ids uniform in [min_token_id, vocab_size) (ids below it are the usual
    pad/bos/eos specials). Listed in arrival order."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_len)
        n_out = rng.randint(*output_len)
        reqs.append(Request([rng.randrange(min_token_id, vocab_size) for _ in range(n_prompt)], n_out))
    return reqs


def fixed_workload(num_requests: int, prompt_len: int, output_len: int, *, seed: int = 0,
                   vocab_size: int = 8192, min_token_id: int = 3) -> list[Request]:
    """`num_requests` requests all with the same prompt and output length (e.g. a pure-decode batch)."""
    return make_workload(num_requests, seed=seed, vocab_size=vocab_size, prompt_len=(prompt_len, prompt_len),
                         output_len=(output_len, output_len), min_token_id=min_token_id)


def useful_tokens(reqs: list[Request]) -> int:
    """Output tokens the requests asked for: the numerator of useful tok/s."""
    return sum(r.max_tokens for r in reqs)


def run_ours(runner, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    """Every request submitted at once to `runner.generate`, greedy, EOS ignored: (seconds, token ids)."""
    from runner_core import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = runner.generate([r.prompt_ids for r in reqs], params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def matches(ids: list[list[int]], ref: list[list[int]]) -> int:
    """How many requests returned exactly the reference's tokens."""
    return sum(a == b for a, b in zip(ids, ref))


def decode_overhead(model: str, dtype: str, device: str, seed: int) -> dict:
    """Mean pure-decode step time at batch 32 (32 requests, prompt 64, 64 outputs), the share of it
    outside the model forward, and what the step's observer (its metrics record; the waste figures are
    not recorded per step unless asked) costs per step."""
    from runner_core import ModelRunner, SamplingParams

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    runner = ModelRunner({"model": model, "dtype": dtype, "device": device, "max_num_seqs": 32}).load_model()
    runner.generate([[5] * 16], [greedy(4)])
    runner.engine.step_metrics.clear()
    observer = runner.engine.observer
    seconds, num_steps = observer.seconds, observer.num_steps
    reqs = fixed_workload(32, 64, 64, seed=seed, vocab_size=runner.engine.vocab_size)
    runner.generate([r.prompt_ids for r in reqs], [greedy(r.max_tokens) for r in reqs])
    steps = [m for m in runner.engine.step_metrics if m.num_prefill_tokens == 0]
    total, fwd = sum(m.total_s for m in steps), sum(m.forward_s for m in steps)
    return {"steps": len(steps), "total_ms": 1e3 * total / len(steps), "forward_ms": 1e3 * fwd / len(steps),
            "share": 1 - fwd / total,
            "observer_us": 1e6 * (observer.seconds - seconds) / (observer.num_steps - num_steps)}
