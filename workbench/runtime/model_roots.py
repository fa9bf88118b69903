"""Where a served dashboard may load local models from.

A dashboard in a notebook runs as its user, who can run any code anyway: it loads any path. A served
dashboard is reached from a browser, so its "local Hugging Face directory" box loads only from its
model roots: the presets' folders, the Hugging Face cache, and the folders given with `--model-root`.
A path is resolved (symlinks, `..`) before it is compared, so no spelling escapes a root.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from runner_core.cache_dir import cache_root
from runner_core.models.catalogue import catalogue_entry
from runner_core.models.presets import SHIPPED_DIR
from workbench.runtime.handles import SessionError


class ModelPathRefused(SessionError):
    """A served dashboard was asked to load a path outside its model roots."""


def default_roots() -> list[Path]:
    from huggingface_hub import constants

    return [SHIPPED_DIR, cache_root() / "presets", Path(constants.HF_HUB_CACHE)]


class ModelRoots:
    def __init__(self, extra: Iterable[str | Path] = ()):
        self.roots = [Path(r).expanduser().resolve() for r in [*default_roots(), *extra]]

    def check(self, model: str) -> str:
        """`model` when it is a catalogue name (a preset, or a config-only model: no path, and the loader refuses
        it with its reason) or a path inside a root; else ModelPathRefused."""
        if catalogue_entry(model) is not None and "/" not in model:
            return model
        path = Path(model).expanduser().resolve()
        if any(path.is_relative_to(root) for root in self.roots):
            return str(path)
        raise ModelPathRefused(
            f"{path} is outside the folders this dashboard loads models from ({', '.join(map(str, self.roots))}); "
            "start it with `python -m workbench serve --model-root DIR` to allow DIR")
