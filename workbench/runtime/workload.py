"""The demo workload: random requests (random prompt lengths, output lengths and seeds) fired at
once, so that continuous batching, block allocation and freeing can be watched."""

from __future__ import annotations

import random
from dataclasses import dataclass

from workbench.runtime.handles import SessionError

WORDS = ("the model reads a token and writes the next one while the scheduler packs many requests into "
         "one batch so that blocks of the cache fill and free as prompts of every length arrive and leave "
         "memory time river stone light paper window garden signal number story engine").split()


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int

    def sampling(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}


def random_requests(n: int, *, prompt_words: tuple[int, int], max_tokens: tuple[int, int], temperature: float,
                    seed: int | None) -> list[WorkloadRequest]:
    """`n` requests (1 to 1024) drawn from one seeded generator: the same seed, the same workload."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
        raise SessionError(f"workload size must be an int in [1, 1024], got {n!r}")
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))]
        requests.append(WorkloadRequest(prompt=" ".join(words), max_tokens=rng.randint(*max_tokens),
                                        temperature=temperature, seed=rng.randrange(2**31)))
    return requests
