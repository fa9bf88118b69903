"""The folder presets, config-only models and native kernels are built into and cached in, and the one
writer of a cached directory (built into a temporary sibling, renamed into place)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where presets and native kernels are built and cached: $RUNNER_WORKBENCH_CACHE, default
    ~/.cache/runner-workbench."""
    return Path(os.environ.get("RUNNER_WORKBENCH_CACHE") or "~/.cache/runner-workbench").expanduser()


def build_cached(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, built first by `build(tmp)` when it is not there: into a temporary sibling renamed into place,
    so a reader never sees a half-written directory. A builder that loses the race to another process (the
    rename finds `final` there) keeps the winner's and drops its own; any other failure is raised, with the
    temporary directory removed."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final
