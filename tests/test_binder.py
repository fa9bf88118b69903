"""What Binder installs runs every lesson: each module a notebook imports comes with binder/'s steps.

mybinder.org installs binder/requirements.txt, then runs binder/postBuild (the project with the extras it
names). Their dependency closure, read from this venv's installed metadata (the project's own as
`make setup` installed it from pyproject.toml), must provide every module the
notebooks import; the check is fast, `make binder-check` is the slow one that installs and runs them all.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.doc_commands import REPO

BINDER = REPO / "binder"
LOCAL = {p.stem for p in REPO.iterdir() if p.suffix == ".py" or p.is_dir()}  # runner_core, benchmarks, ...


def binder_requirements() -> list[Requirement]:
    """binder/requirements.txt's requirements and the project's with the extras postBuild installs."""
    reqs = [Requirement(line.split("#")[0].strip()) for line in (BINDER / "requirements.txt").read_text().splitlines()
            if line.split("#")[0].strip() and not line.startswith("-")]
    installs = re.findall(r"pip install [^\n]*?-e \"?\.\[([\w,]+)\]", (BINDER / "postBuild").read_text())
    assert installs, "binder/postBuild no longer installs the project with `pip install -e .[extras]`"
    return reqs + [Requirement(f"runner-workbench[{extras}]") for extras in installs]


def closure(reqs: list[Requirement]) -> set[str]:
    """The distributions those requirements pull in, by the installed metadata (canonical names)."""
    seen, todo = set(), [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements are unknown (the import check then names it)
        extras = [*req.extras, ""]
        todo += [r for r in map(Requirement, requires)
                 if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras)]
    return {name for name, _ in seen}


def notebook_imports() -> dict[str, set[str]]:
    """{top-level module: the notebooks importing it}, from every code cell (IPython magics left out)."""
    out: dict[str, set[str]] = {}
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "\n".join(line for line in "".join(cell["source"]).splitlines()
                            if not line.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(src)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                for name in names:
                    out.setdefault(name.split(".")[0], set()).add(nb.name)
    return out


def missing_from(installed: set[str], imports: dict[str, set[str]]) -> dict[str, list[str]]:
    """{module: notebooks} for the imports no distribution in `installed` provides."""
    provided = importlib.metadata.packages_distributions()
    missing = {}
    for module, notebooks in sorted(imports.items()):
        if module in sys.stdlib_module_names or module in LOCAL:
            continue
        if not {canonicalize_name(d) for d in provided.get(module, [])} & installed:
            missing[module] = sorted(notebooks)
    return missing


def test_binder_installs_every_module_the_notebooks_import():
    imports = notebook_imports()
    assert {"runner_core", "workbench", "plotly"} <= set(imports)  # the parse sees the lessons' imports
    missing = missing_from(closure(binder_requirements()), imports)
    assert not missing, (f"Binder's steps (binder/requirements.txt, binder/postBuild) install nothing that "
                         f"provides {missing}: add it to the extra postBuild installs (pyproject.toml)")


def test_the_check_names_a_module_only_the_test_extra_installs():
    imports = {"openai": {"10-tuning.ipynb"}, "plotly": {"02.ipynb"}, "json": {"02.ipynb"}}
    assert missing_from(closure([Requirement("plotly")]), imports) == {"openai": ["10-tuning.ipynb"]}


def test_the_closure_follows_extras_and_markers():
    # transformers requires huggingface-hub always, and torch only through its `torch` extra
    plain = closure([Requirement("transformers")])
    assert "huggingface-hub" in plain and "torch" not in plain
