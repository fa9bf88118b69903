"""Fault-injection points for tests: where a step's forward, its logits, a compile or a cache write can
be made to fail, so the engine's recovery is tested on the real code path.

Production code calls `fire(point, value)` at each point; with nothing injected it returns `value`
unchanged (one dict lookup). A test injects a hook with `inject(point, hook)`: the hook receives the
value and returns a replacement or raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

POINTS = {
    "forward": "the worker, before a step's forward (value: the StepBatch)",
    "logits": "the worker, after a step's forward (value: the logits [rows, vocab])",
    "compile": "a compile switch, before compiling (value: the model)",
    "cache_write": "the compile cache, before a file is written (value: its path)",
}

_hooks: dict[str, Callable[[Any], Any]] = {}


def fire(point: str, value: Any = None) -> Any:
    hook = _hooks.get(point)
    return value if hook is None else hook(value)


@contextmanager
def inject(point: str, hook: Callable[[Any], Any]) -> Iterator[None]:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; the points are {', '.join(POINTS)}")
    _hooks[point] = hook
    try:
        yield
    finally:
        _hooks.pop(point, None)
