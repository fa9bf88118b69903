"""The one way the benchmarks compare two figures: like with like, or an error.

A `Figure` is a value with what it was measured on: the device ("cpu", "cuda:0") and the condition
(e.g. "eager", "compiled, caches cold"). `ratio()` divides two figures only when both devices are
the same, and (unless the caller labels the comparison an extra with `like=False`) both conditions
too; otherwise it raises `UnlikeFigures` naming both sides, so no verdict can print a share of a CPU
peak for a GPU engine, or an eager time over a compiled one. `verdict()` is the printed line.
"""

from __future__ import annotations

from dataclasses import dataclass


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
            percent: bool = False) -> tuple[str, float]:
    """The printed line for `name` = num / den against `target` (>= when at_least, else <=; None: the
    ratio alone), and the ratio; raises UnlikeFigures for unlike inputs instead of printing a figure."""
    r = ratio(num, den, like=like)
    fmt = (lambda x: f"{100 * x:.0f}%") if percent else (lambda x: f"{x:.2f}x")
    if target is None:
        return f"{name}: {fmt(r)}", r
    met = r >= target if at_least else r <= target
    return (f"{name}: {fmt(r)}; target {'>=' if at_least else '<='} {fmt(target)}: {'met' if met else 'NOT met'}",
            r)
