"""The engine's clock: the wall clock of a real run, or the virtual clock of a simulated one (the what-if
simulator advances it by each step's predicted time). Everything that stamps a request or a step (the
scheduler, the output processor, the step observer, the load driver) reads the engine's clock."""

from __future__ import annotations

import time


class WallClock:
    """time.perf_counter(); waiting sleeps."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def sleep_until(t: float) -> None:
        time.sleep(max(0.0, t - time.perf_counter()))


class VirtualClock:
    """Seconds since the simulation began; only `advance` and `sleep_until` move it, instantly."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds!r})")
        self.t += seconds

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)
