"""The demo workload: random requests (random prompt lengths, output lengths and seeds) arriving at
random over a few seconds, their prompts opening with one shared instruction, so that continuous
batching, block allocation and freeing, prefix-cache hits and, on a small pool, preemption can be
watched as they happen."""

from __future__ import annotations

import random
from dataclasses import dataclass

from workbench.runtime.handles import SessionError

WORDS = ("the model reads a token and writes the next one while the scheduler packs many requests into "
         "one batch so that blocks of the cache fill and free as prompts of every length arrive and leave "
         "memory time river stone light paper window garden signal number story engine").split()


SHARED_PREFIX = ("Write the next part of the story below in plain words, one sentence after another, and keep "
                 "to the same people and places:")  # every prompt's opening: whole cached blocks to share


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    arrival: float = 0.0  # seconds after the workload starts
    ignore_eos: bool = False  # write all max_tokens

    def sampling(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed,
                "ignore_eos": self.ignore_eos}


# The demo `make run` offers: on tiny-speaker with the dashboard's 16 MiB pool (256 blocks of 16 tokens) and prefix
# caching, its 64 requests (about 2.7 s of arrivals; prompts up to 88 tokens, so 88 + 400 fit its 512 positions)
# ran 7.0 s through the session on a 2-core Zen 4: 1104 steps, up to 46 requests running, 122 preemptions, 53% of
# prompt tokens from the prefix cache (2026-12-05). A faster machine runs it sooner: slow it down with the pace.
DEMO = {"n": 64, "rate": 24.0, "prompt_words": (4, 24), "max_tokens": (192, 400), "temperature": 0.8,
        "shared_prefix": True, "ignore_eos": True}


def describe(n: int, rate: float, prompt_words: tuple[int, int], max_tokens: tuple[int, int],
             shared_prefix: bool, ignore_eos: bool, **_) -> str:
    """What a workload will do, in a sentence (the dashboard's workload form says it)."""
    arrive = f"arriving at random, {rate:g} a second on average (about {n / rate:.0f} s)" if rate else "all at once"
    opening = "one shared instruction, then " if shared_prefix else ""
    words = f"{prompt_words[0]}-{prompt_words[1]} random words"
    tokens = f"{max_tokens[0]}-{max_tokens[1]} tokens each{' (end of text ignored)' if ignore_eos else ''}"
    return f"{n} requests {arrive}; prompts: {opening}{words}; answers of {tokens}"


def random_requests(n: int, *, prompt_words: tuple[int, int], max_tokens: tuple[int, int], temperature: float,
                    seed: int | None, rate: float = 0.0, shared_prefix: bool = False,
                    ignore_eos: bool = False) -> list[WorkloadRequest]:
    """`n` requests (1 to 1024) drawn from one seeded generator: the same seed, the same workload. Their
    arrivals are a Poisson process of `rate` requests a second (0: all at once); with `shared_prefix` each
    prompt opens with SHARED_PREFIX."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
        raise SessionError(f"workload size must be an int in [1, 1024], got {n!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 10_000:
        raise SessionError(f"workload rate must be a number of requests a second in [0, 10000], got {rate!r}")
    rng = random.Random(seed)
    requests, arrival = [], 0.0
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))]
        prompt = " ".join(([SHARED_PREFIX] if shared_prefix else []) + words)
        requests.append(WorkloadRequest(prompt=prompt, max_tokens=rng.randint(*max_tokens), temperature=temperature,
                                        seed=rng.randrange(2**31), arrival=round(arrival, 3), ignore_eos=ignore_eos))
        arrival += rng.expovariate(rate) if rate else 0.0
    return requests
