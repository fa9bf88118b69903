"""The one way the benchmarks compare two figures: like with like, or an error; and on a quiet machine,
or no verdict.

A `Figure` is a value with what it was measured on: the device ("cpu", "cuda:0") and the condition
(e.g. "eager", "compiled, caches cold"). `ratio()` divides two figures only when both devices are
the same, and (unless the caller labels the comparison an extra with `like=False`) both conditions
too; otherwise it raises `UnlikeFigures` naming both sides, so no verdict can print a share of a CPU
peak for a GPU engine, or an eager time over a compiled one. `verdict()` is the printed line.

`quiet_at_start()` reads the machine's 1-minute load average against its cores as a benchmark starts,
before it runs anything of its own (`Quiet`, recorded in the JSON line). Above QUIET_LOAD_PER_CORE a
speed verdict is refused: `outcome()` (and `verdict(quiet=...)`) say "refused: machine not quiet (load
X on N cores)" instead of met or not met; the figures are still printed.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

# A quiet machine: at most half a runnable process per core from others (the kernel's 1-minute load average,
# for the whole machine). At 1.6-2.3 on 2 cores (other sessions) the contention benchmark's "idle" runs came
# out slower than its busy ones (busy / idle 1.41 and 1.11): a baseline that was not one.
QUIET_LOAD_PER_CORE = 0.5


@dataclass(frozen=True)
class Quiet:
    """The load the machine carried from others (the 1-minute load average at a benchmark's start, or
    the cores other processes kept busy during one run: `during` names it) against its cores."""

    load: float
    cores: int
    during: str = ""

    @property
    def limit(self) -> float:
        return QUIET_LOAD_PER_CORE * self.cores

    @property
    def ok(self) -> bool:
        return self.load <= self.limit

    def refusal(self) -> str:
        during = f" during {self.during}" if self.during else ""
        return f"refused: machine not quiet (load {self.load:.2f} on {self.cores} cores{during})"

    def as_dict(self) -> dict:
        return {"load_1min" if not self.during else "load": self.load, "cores": self.cores, "limit": self.limit,
                "quiet": self.ok, **({"during": self.during} if self.during else {})}


def quiet_at_start() -> Quiet:
    """The 1-minute load average (os.getloadavg) against os.cpu_count(): call it first thing."""
    return Quiet(os.getloadavg()[0], os.cpu_count() or 1)


def spread(values: list[float]) -> dict:
    """The median and range of a figure over rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def announce_start() -> tuple[Quiet, str]:
    """`quiet_at_start()` (call it first thing) and the CPU's name and kernel tier, both printed."""
    start = quiet_at_start()
    from runner_core.host import machine_name

    name = machine_name()
    print(f"CPU and tier: {name}")
    print(f"load average at the start: {start.load:.2f} on {start.cores} cores (quiet up to {start.limit:.2f}: "
          f"{'quiet' if start.ok else 'NOT quiet, the speed verdict refused'})", flush=True)
    return start, name


def outcome(met: bool, *quiet: Quiet | None, words: tuple[str, str] = ("met", "NOT met")) -> str:
    """A verdict's word: words[0] when met, words[1] when not; the first refusal among `quiet` where one
    says the machine was busy."""
    busy = next((q for q in quiet if q is not None and not q.ok), None)
    return busy.refusal() if busy else words[0 if met else 1]


class UnlikeFigures(ValueError):
    """Two figures from different devices (or conditions) were about to be compared."""


@dataclass(frozen=True)
class Figure:
    value: float
    device: str
    condition: str = ""
    label: str = ""

    def describe(self) -> str:
        what = ", ".join(x for x in (self.device, self.condition) if x)
        return f"{self.label or 'figure'} ({what})"


def ratio(num: Figure, den: Figure, like: bool = True) -> float:
    """num / den, refusing unlike inputs: different devices always; different conditions when
    `like` and both figures name one (a device's limit has none; pass like=False only for a
    comparison printed as a labelled extra)."""
    if num.device != den.device:
        raise UnlikeFigures(f"refusing to compare {num.describe()} with {den.describe()}: they were measured on "
                            "different devices; measure both on the same device (or print no comparison)")
    if like and num.condition and den.condition and num.condition != den.condition:
        raise UnlikeFigures(f"refusing to compare {num.describe()} with {den.describe()}: their conditions differ; "
                            "compare eager with eager and compiled with compiled (same cache state)")
    if den.value <= 0:
        raise UnlikeFigures(f"refusing to divide by {den.describe()} = {den.value!r}: it must be positive")
    return num.value / den.value


def verdict(name: str, num: Figure, den: Figure, target: float | None, at_least: bool = True, like: bool = True,
            percent: bool = False, quiet: Quiet | None = None) -> tuple[str, float]:
    """The printed line for `name` = num / den against `target` (>= when at_least, else <=; None: the
    ratio alone), and the ratio; raises UnlikeFigures for unlike inputs instead of printing a figure; a
    `quiet` that says the machine was busy refuses the verdict (the ratio is still printed)."""
    r = ratio(num, den, like=like)
    fmt = (lambda x: f"{100 * x:.0f}%") if percent else (lambda x: f"{x:.2f}x")
    if target is None:
        return f"{name}: {fmt(r)}", r
    met = r >= target if at_least else r <= target
    return f"{name}: {fmt(r)}; target {'>=' if at_least else '<='} {fmt(target)}: {outcome(met, quiet)}", r
