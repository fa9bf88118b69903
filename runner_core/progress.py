"""Progress bars for long work (the native kernel build, compiles, weight loading): tqdm's, which
render as a widget in Jupyter (`tqdm.auto`) and as a text bar on a terminal, and stay silent
where stderr is not a terminal (logs, CI). `ticking` keeps a bar's elapsed time moving while one
long step runs, so a bar at 0 of N still shows that work goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

TICK_S = 0.5


def progress(iterable: Iterable | None = None, *, desc: str, total: int | None = None, unit: str = "it",
             leave: bool = True):
    """A tqdm bar (tqdm.auto: a widget in a notebook); disabled when stderr is no terminal."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, disable=None, dynamic_ncols=True)


@contextmanager
def ticking(bar, every: float = TICK_S) -> Iterator[None]:
    """Refresh `bar` every `every` seconds while the block runs (its elapsed time moves)."""
    if getattr(bar, "disable", True):
        yield
        return
    stop = threading.Event()

    def tick():
        while not stop.wait(every):
            bar.refresh()

    thread = threading.Thread(target=tick, name="runner-core-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
