"""The layout's promises (ARCHITECTURE.md): no import cycle among the project's modules, module-level
or lazy (a name imported through a package's __init__ counts as an import of the module defining
it); runner_core imports neither workbench nor a UI package; no module over 400 lines; no module reads
or imports a private name (`_x`) that another of the project's modules defines, other than a class's own
through `self` (a library's privates, such as torch's, are another matter)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runner_core", "workbench")
UI = ("panel", "plotly", "ipywidgets", "bokeh", "IPython", "jupyter", "anywidget", "workbench")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _import_statements(name: str, path: Path):
    """Each import anywhere in the file (lazy and TYPE_CHECKING ones included) as (the module it reads from,
    the names it takes: None for `import x`), relative imports made absolute."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base, [alias.name for alias in node.names]


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in the file, as the project modules it names."""
    found = set()
    for base, names in _import_statements(name, path):
        found.add(base)
        found.update(f"{base}.{n}" for n in names or ())
    return found


def _defining_module(target: str) -> str | None:
    """The project module `target` (a module, or package.name) resolves to, through re-exports."""
    if target in MODULES and MODULES[target].name != "__init__.py":
        return target
    package, _, attr = target.rpartition(".")
    if package in MODULES and MODULES[package].name == "__init__.py":
        for node in ast.parse(MODULES[package].read_text()).body:
            if isinstance(node, ast.ImportFrom) and any(a.asname == attr or a.name == attr for a in node.names):
                return _defining_module(node.module) if node.module else None
    return None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        edges = {_defining_module(t) for t in _imports(name, path)}
        graph[name] = {e for e in edges if e and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                out.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_check_sees_a_cycle_through_a_package_init():
    """The checker itself: a lazy import through a package's re-export closes a cycle."""
    graph = _graph()
    graph["runner_core.config"] = graph["runner_core.config"] | {_defining_module("runner_core.engine.LLMEngine")}
    assert any("runner_core.config" in c and "runner_core.engine.engine" in c for c in _cycles(graph))


def test_runner_core_imports_no_ui_and_no_workbench():
    bad = [(name, target) for name, path in MODULES.items() if name.startswith("runner_core")
           for target in _imports(name, path) if target.split(".")[0] in UI]
    assert bad == []


def test_no_module_is_over_400_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, assignments (module, class, `self.`/`cls.`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if _private(n)}


def _own(value: ast.AST) -> bool:
    """`self`, `cls` or `super()`: a class reading what it inherits (a base's `_x` is its subclasses' too)."""
    return (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")


def _private_reads(modules: dict[str, Path]) -> list[str]:
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    defined = {name: _defined_privates(tree) for name, tree in trees.items()}
    ours = set().union(*defined.values())
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGES):
                found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if _private(a.name)]
            elif (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in ours
                  and node.attr not in defined[name] and not _own(node.value)):
                found.append(f"{name}:{node.lineno} reads {ast.unparse(node)}")
    return sorted(found)


def test_no_module_reads_another_modules_private_names():
    assert _private_reads(MODULES) == []


def test_no_benchmark_imports_a_private_name():
    """A benchmark script uses what a user may (a private name moves without notice: benchmarks/native_kernels.py
    stopped at an ImportError when attention's decode helper moved)."""
    scripts = {f"benchmarks.{p.stem}": p for p in sorted((REPO / "benchmarks").glob("*.py"))}
    assert [line for line in _private_reads({**MODULES, **scripts}) if line.startswith("benchmarks.")] == []


def test_the_private_check_sees_a_read_and_an_import(tmp_path):
    (tmp_path / "a.py").write_text("class A:\n    def _hidden(self):\n        self._state = 1\n")
    (tmp_path / "b.py").write_text("from runner_core.x import _helper\n\ndef f(a):\n    return a._hidden(), a._state\n")
    found = _private_reads({"a": tmp_path / "a.py", "b": tmp_path / "b.py"})
    assert found == ["b:1 imports _helper", "b:4 reads a._hidden", "b:4 reads a._state"]


def _levels() -> dict[str, list[set[str]]]:
    """ARCHITECTURE.md's level lines (```levels block): `package: a b < c < d`, lowest first; names on one level
    are separated by spaces, levels by `<`; `base` stands for the package's top-level modules not named."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    block = text.split("```levels\n", 1)[1].split("```", 1)[0]
    out = {}
    for line in block.strip().splitlines():
        package, _, order = line.partition(":")
        out[package.strip()] = [set(level.split()) for level in order.split("<")]
    return out


def _unit(package: str, target: str, levels: list[set[str]]) -> str:
    """The folder, or top-level module, of `package` that the dotted `target` lies in (`base` for the
    top-level modules the level lines do not name; `__init__` for the package's own namespace)."""
    parts = target.split(".")
    if len(parts) == 1:
        return "__init__"
    head = parts[1]
    named = set().union(*levels)
    if head in named:
        return head
    if (REPO / package / head).is_dir() or (REPO / package / f"{head}.py").is_file():
        return "base"
    return "__init__"  # a name defined or re-exported by the package's __init__


def _module_imports(name: str, path: Path) -> set[str]:
    """The modules (or package namespaces) `name` imports anywhere in its file, lazy and TYPE_CHECKING
    imports included: `from p import x` is p.x where p.x is a module or folder, else p."""
    found = set()
    for base, names in _import_statements(name, path):
        if names is None:
            found.add(base)
        for n in names or ():
            as_path = REPO / Path(*f"{base}.{n}".split("."))
            found.add(f"{base}.{n}" if as_path.is_dir() or as_path.with_suffix(".py").is_file() else base)
    return found


def _upward_imports(modules: dict[str, Path], levels: dict[str, list[set[str]]]) -> list[str]:
    """Every import that runs from a level to a higher one, within a package or between packages."""
    packages = levels["packages"]
    rank = {p: i for i, level in enumerate(packages) for p in level}
    found = []
    for name, path in modules.items():
        here = name.split(".")[0]
        own = levels[here]
        level_of = {u: i for i, level in enumerate(own) for u in level}
        unit = _unit(here, name, own) if name != here else "__init__"
        for target in sorted(_module_imports(name, path)):
            there = target.split(".")[0]
            if there not in rank:
                continue
            if there != here:
                if rank[there] >= rank[here]:
                    found.append(f"{name} imports {target} ({there} is not below {here})")
                continue
            to = _unit(there, target, own)
            if to != unit and level_of[to] > level_of[unit]:
                found.append(f"{name} ({unit}) imports {target} ({to}, a higher level)")
    return found


def test_every_import_runs_down_the_levels_architecture_md_draws():
    levels = _levels()
    modules = {n: p for n, p in MODULES.items()}
    modules.update({".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
                    for p in sorted((REPO / "runner_tools").rglob("*.py"))})
    listed = {pkg: set().union(*lv) - {"base"} for pkg, lv in levels.items() if pkg != "packages"}
    for pkg, units in listed.items():  # every folder and named module is on the map, and nothing else
        present = {p.name for p in (REPO / pkg).iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
        assert present <= units, f"{pkg}: folders missing from ARCHITECTURE.md's levels: {present - units}"
        missing = {u for u in units if not ((REPO / pkg / u).is_dir() or (REPO / pkg / f"{u}.py").is_file())}
        assert not missing, f"{pkg}: ARCHITECTURE.md's levels name what is not there: {missing}"
    assert _upward_imports(modules, levels) == []


def test_the_level_check_sees_an_import_up_a_level(tmp_path):
    levels = {"packages": [{"runner_core"}, {"workbench"}],
              "runner_core": [{"base"}, {"layers"}, {"engine"}, {"__main__", "__init__"}],
              "workbench": [{"runtime"}, {"views"}, {"__main__", "__init__"}]}
    (tmp_path / "m.py").write_text("def f():\n    from runner_core.engine.scheduler import Scheduler\n")
    (tmp_path / "w.py").write_text("from workbench.views.charts import x\nfrom runner_core import ModelRunner\n")
    (tmp_path / "c.py").write_text("import workbench.runtime\n")
    found = _upward_imports({"runner_core.layers.linear": tmp_path / "m.py", "workbench.runtime.handles":
                             tmp_path / "w.py", "runner_core.config": tmp_path / "c.py"}, levels)
    assert found == ["runner_core.layers.linear (layers) imports runner_core.engine.scheduler (engine, a higher level)",
                     "workbench.runtime.handles (runtime) imports workbench.views.charts (views, a higher level)",
                     "runner_core.config imports workbench.runtime (workbench is not below runner_core)"]


def _map_rows() -> dict[str, set[str]]:
    """ARCHITECTURE.md's folder tables: folder -> the `*.py` modules its row names."""
    rows = {}
    for line in (REPO / "ARCHITECTURE.md").read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().startswith("`") and cells[1].strip().endswith("/`"):
            rows[cells[1].strip().strip("`")] = set(re.findall(r"`([\w/]+\.py)`", "|".join(cells[2:])))
    return rows


def test_architecture_md_names_every_module_of_every_folder_and_no_other():
    rows = _map_rows()
    folders = {f"{p.relative_to(REPO)}/" for pkg in (*PACKAGES, "runner_tools")
               for p in [REPO / pkg, *(REPO / pkg).rglob("*")] if (p / "__init__.py").is_file()}
    assert set(rows) == folders
    for folder, named in rows.items():
        present = {p.name for p in (REPO / folder).glob("*.py") if p.name != "__init__.py"}
        assert named == present, f"{folder}: not on the map {present - named}, on the map only {named - present}"
