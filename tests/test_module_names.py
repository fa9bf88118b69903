"""No module of the project shadows an installed distribution or the standard library.

Python puts a folder first on sys.path when it runs a file there as a script (`python benchmarks/X.py`),
when pytest imports a test file from a folder without `__init__.py` (tests/), and for `python -m` and a
notebook's kernel (the current folder). A module there named like an installed distribution is
imported in its place by everything that runs later, transformers included (it imports `kernels`, the
kernel hub, while reading a config: a benchmarks/kernels.py stopped every benchmark at its first load).
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from tests.doc_commands import REPO, doc_commands, recipe_commands

OWN_DISTRIBUTION = "runner-workbench"


def top_level_names(folder: Path) -> set[str]:
    """The names a folder on sys.path provides: its modules and its regular packages."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names


def shadowed(folder: Path) -> dict[str, str]:
    """{name: what it shadows} for the folder's modules named like a distribution's or the stdlib's."""
    provided = importlib.metadata.packages_distributions()
    out = {}
    for name in sorted(top_level_names(folder)):
        dists = [d for d in provided.get(name, []) if d.lower() != OWN_DISTRIBUTION]
        if dists:
            out[name] = "the installed distribution " + ", ".join(sorted(set(dists)))
        elif name in sys.stdlib_module_names:
            out[name] = "the standard library's module"
    return out


def folders_put_on_sys_path() -> set[Path]:
    """The repository root (`python -m`), tests/ (pytest), notebooks/ (a kernel's current folder) and
    every folder whose scripts the docs or the Makefile run by path."""
    folders = {REPO, REPO / "tests", REPO / "notebooks"}
    folders |= {(REPO / c.script).parent for c in doc_commands() + recipe_commands() if c.script}
    return folders


def test_the_scripts_folders_are_found_from_the_docs():
    assert REPO / "benchmarks" in folders_put_on_sys_path()


def test_no_module_shadows_an_installed_distribution():
    found = {f"{folder.relative_to(REPO)}/{name}": what
             for folder in folders_put_on_sys_path() for name, what in shadowed(folder).items()}
    assert not found, (
        f"these modules shadow what Python would otherwise import: {found}; rename them "
        "(CONTRIBUTING.md, 'Module names')")


def test_the_check_sees_a_module_named_like_a_distribution(tmp_path):
    (tmp_path / "transformers.py").write_text("")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    (tmp_path / "namespace_only").mkdir()  # no __init__: a namespace portion never wins over a package
    (tmp_path / "measure_things.py").write_text("")
    assert shadowed(tmp_path) == {"json": "the standard library's module",
                                  "transformers": "the installed distribution transformers"}
