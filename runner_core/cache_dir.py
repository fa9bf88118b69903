"""The folder presets and native kernels are built into and cached in."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where presets and native kernels are built and cached: $RUNNER_WORKBENCH_CACHE, default
    ~/.cache/runner-workbench."""
    return Path(os.environ.get("RUNNER_WORKBENCH_CACHE") or "~/.cache/runner-workbench").expanduser()
