"""`Stats`: the session's statistics (memory, compile, defragment, unload) as a dict that reads
well: `print(stats)` is a two-column table and a notebook shows an HTML table, with figures
rounded (bytes in MiB, fractions in %, seconds to the hundredth). Code indexes it as the plain
dict runner_core returned; the numbers in it are unchanged, only their display is rounded.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

MIB = 2**20
# keys whose value is a fraction of something (0..1), shown in percent
FRACTION_WORDS = ("utilization", "fragmentation", "waste", "hit_rate", "acceptance_rate")


def format_value(key: str, value: Any) -> str:
    """`value` for display, rounded by what `key` says it is (bytes, seconds, a fraction)."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, Mapping):
            # a nested figure is named by its own key when it has one ("build_seconds"), else by its parent's
            return ", ".join(f"{k}: {format_value(k if isinstance(k, str) else key, v)}"
                             for k, v in value.items()) or "–"
        if isinstance(value, (list, tuple)):
            return ", ".join(format_value(key, v) for v in value) or "–"
        return str(value)
    if "bytes" in key:
        if value == 0:
            return "0"
        return f"{value / MIB:,.1f} MiB" if abs(value) >= MIB / 10 else f"{value / 1024:,.1f} KiB"
    if key.endswith("seconds"):
        return f"{value:,.2f} s" if abs(value) >= 0.01 or value == 0 else f"{value * 1e3:.2f} ms"
    if isinstance(value, float) and any(w in key for w in FRACTION_WORDS) and 0 <= value <= 1:
        return f"{100 * value:.1f} %"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return f"{value:,}"


class Stats(dict):
    """A dict of statistics with a readable `__str__` table and a notebook `_repr_html_`."""

    def __init__(self, data: Mapping[str, Any] = (), title: str = ""):
        super().__init__(data)
        self.title = title

    def rows(self) -> list[tuple[int, str, str]]:
        """(depth, key, rounded value) for each entry; a nested mapping with names for keys
        (decode_programs) is a heading row followed by its own rows one level deeper."""
        return list(_rows(self, 0))

    def __str__(self) -> str:
        rows = self.rows()
        if not rows:
            return f"{self.title}: (empty)" if self.title else "(empty)"
        width = max(2 * depth + len(key) for depth, key, _ in rows)
        lines = [self.title] if self.title else []
        lines += [f"  {'  ' * depth + key:<{width}}  {value}".rstrip() for depth, key, value in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        cells = "".join(
            f'<tr><th style="text-align:left;font-weight:normal;padding:1px 16px 1px {1.2 * depth}em">'
            f'{html.escape(key)}</th><td style="text-align:left;font-variant-numeric:tabular-nums;padding:1px 0">'
            f"{html.escape(value)}</td></tr>" for depth, key, value in self.rows())
        caption = (f'<caption style="text-align:left;font-weight:bold">{html.escape(self.title)}</caption>'
                   if self.title else "")
        return f'<table style="border-collapse:collapse;font-size:12px">{caption}{cells}</table>'

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython in a terminal
        printer.text(str(self))


def _rows(data: Mapping, depth: int):
    for k, v in data.items():
        if isinstance(v, Mapping) and v and all(isinstance(name, str) for name in v):
            yield depth, str(k), ""
            yield from _rows(v, depth + 1)
        else:
            yield depth, str(k), format_value(str(k), v)
