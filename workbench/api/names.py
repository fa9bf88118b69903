"""The names the API serves its models under: a model loaded from a directory is served under the directory's
name, never its filesystem path; a preset or hub id is served as it is. Two models whose names would clash
get -2, -3... A request may name a model by its served name or by the session's name for it."""

from __future__ import annotations

import functools
import os
from pathlib import Path


def served_names(session) -> dict[str, str]:
    """The session's model names -> the names served, in load order (names that are no path claim first)."""
    names = list(session.models)
    public = {name: _public(name) for name in names}
    served, taken = {}, set()
    for name in sorted(names, key=lambda n: public[n] != n):  # stable: plain names first, then paths
        candidate, i = public[name], 2
        while candidate in taken:
            candidate, i = f"{public[name]}-{i}", i + 1
        taken.add(candidate)
        served[name] = candidate
    return {name: served[name] for name in names}


def session_name(session, requested: str) -> str | None:
    """The session's name of the model a request names (served or session name); None when none is loaded."""
    served = served_names(session)
    if requested in served:
        return requested
    return next((name for name, public in served.items() if public == requested), None)


@functools.lru_cache(maxsize=256)
def _public(name: str) -> str:
    path = Path(name).expanduser()
    looks_like_path = path.is_absolute() or name.startswith(".") or os.sep in name or "/" in name
    if looks_like_path and (path.is_absolute() or path.exists()):
        return path.resolve().name or name.strip("/") or "model"
    return name
