"""The documentation a newcomer reads: every relative link in README.md, docs/, ARCHITECTURE.md,
CONTRIBUTING.md and the notebooks' markdown resolves to a file of the repository (and to a heading,
where it names an anchor); the README stays short and keeps its two commands; no document or source
points at a file outside the repository; the docs state current facts, not project history."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def markdown_documents() -> dict[str, tuple[Path, str]]:
    """Each document's display name -> (the folder its links are relative to, its markdown)."""
    paths = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "CONTRIBUTING.md",
             *sorted((REPO / "docs").glob("*.md"))]
    docs = {str(p.relative_to(REPO)): (p.parent, p.read_text(encoding="utf-8")) for p in paths}
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        docs[str(nb.relative_to(REPO))] = (nb.parent, text)
    return docs


def prose(markdown: str) -> str:
    """The markdown without code blocks and inline code, where link syntax is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a document's headings, duplicates numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(name: str, folder: Path, markdown: str, root: Path = REPO) -> list[str]:
    """The relative links of one document under `root` that lead nowhere, each with the reason."""
    problems = []
    for target in LINK.findall(prose(markdown)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        path = (folder / path_part).resolve() if path_part else folder / Path(name).name
        if path_part and not path.is_relative_to(root):
            problems.append(f"{name}: {target} points outside the repository")
        elif path_part and not path.exists():
            problems.append(f"{name}: {target} -> no file {path.relative_to(root)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text(encoding="utf-8")):
            problems.append(f"{name}: {target} -> no heading with anchor #{anchor} in {path.relative_to(root)}")
    return problems


DOCUMENTS = markdown_documents()


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_every_relative_link_resolves(name):
    folder, markdown = DOCUMENTS[name]
    assert broken_links(name, folder, markdown) == []


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "page.md").write_text("# A page\n\n## Some section\n")
    text = ("[ok](page.md#some-section) [gone](missing.md) [no anchor](page.md#other) "
            "`[in code](missing.md)` [web](https://example.com) [up](../elsewhere.md)")
    problems = broken_links("index.md", tmp_path, text, root=tmp_path)
    assert len(problems) == 3, problems
    assert "no file missing.md" in problems[0] and "#other" in problems[1] and "outside" in problems[2]


def test_slugs_follow_github():
    assert slug("Images (LLaVA)") == "images-llava"
    assert slug("Multi-GPU, on paper") == "multi-gpu-on-paper"
    assert slug("`make bench`: figures") == "make-bench-figures"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_readme_is_short_and_keeps_the_two_commands():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES, "move detail into docs/ and link to it"
    for command in ("make run", "make test"):
        assert re.search(rf"^{command}\b", readme, re.M), f"the README lost its `{command}` line"
    for page in ("engine", "memory", "compile", "parallel", "models", "workbench", "reliability", "benchmarks"):
        assert f"(docs/{page}.md)" in readme, f"the README does not link docs/{page}.md"


# Files that live beside the repository on the machines it was written on, never in a clone.
OUTSIDE = re.compile(r"\.\./shared|\bshared/(?:NOTES|DESIGN)\.md|\bDESIGN\.md|\bNOTES\.md|\bseed/\d|/work/main")
SOURCES = ("runner_core", "runner_tools", "workbench", "tests", "benchmarks", "notebooks", "docs", "binder", ".ci")


def test_nothing_points_outside_the_repository():
    files = [REPO / n for n in ("README.md", "ARCHITECTURE.md", "CONTRIBUTING.md", "Makefile", "pyproject.toml")]
    for folder in SOURCES:
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in {".py", ".md", ".ipynb", ".txt", ""}
                  and p.is_file() and p != Path(__file__).resolve()]
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}"
            for p in files for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert hits == [], "cite the article by its title, or state the fact here"


def test_docs_state_current_facts_not_history():
    pattern = re.compile(r"\b(?:issue|session|wave) \d+\b", re.I)
    hits = [f"{name}: {m.group(0)}" for name, (_, text) in DOCUMENTS.items()
            if not name.endswith(".ipynb") for m in pattern.finditer(text)]
    assert hits == [], "history belongs in commit messages; the docs say what is true now"


# Figures the docs quote whose truth is a constant of a test, a benchmark or the code: each is read where it
# is defined (Python constants parsed, not imported; the kernels' header searched) and held to the docs' words.
FRACTIONS = {"half": 1 / 2, "a third": 1 / 3, "a quarter": 1 / 4, "a fifth": 1 / 5}


def constants(path: Path) -> dict:
    """The module-level constants of a Python file whose values are literals."""
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def quoted(name: str, pattern: str) -> tuple[str, ...]:
    """The groups of `pattern` in document `name`, its lines joined by single spaces."""
    m = re.search(pattern, " ".join(DOCUMENTS[name][1].split()))
    assert m, f"{name} no longer says {pattern!r}: say the figure as the test or code holds it, or change both"
    return m.groups()


def test_the_unload_bounds_the_docs_quote_are_the_tests():
    bounds = constants(REPO / "tests" / "test_unload_memory.py")
    share, = quoted("docs/memory.md", r"after unload the process stays within (half|a third|a quarter|a fifth) "
                                      r"the weights of where it was before, in the median of three cycles")
    assert FRACTIONS[share] == bounds["UNLOAD_SHARE_OF_WEIGHTS"]
    shutdown, = quoted("docs/memory.md", r"`runner\.shutdown\(\)` of tiny-llama leaves under (\d+) MiB")
    growth, = quoted("docs/memory.md", r"20 load/unload cycles of tiny-llama grow under (\d+) MiB after the fifth")
    assert (int(shutdown), int(growth)) == (bounds["SHUTDOWN_LEFT_MIB"], bounds["GROWTH_MIB"])


def test_the_register_tiles_the_docs_quote_are_the_kernels():
    header = (REPO / "runner_core" / "kernels" / "panel_tile.h").read_text(encoding="utf-8")
    avx512, rest = header.split("#elif defined(__AVX2__)", 1)
    avx2 = rest.split("\n#else", 1)[0]
    kernel = (int(re.search(r"for \(; r \+ (\d+) <= m; r \+= \1\)", avx512)[1]),
              int(re.search(r"PANELS_PER_TILE = (\d+);", avx512)[1]),
              *(int(re.search(rf"struct {t} \{{.*?MR = (\d+);", avx2, re.S)[1]) for t in ("F32", "BF16")),
              int(re.search(r"PANELS_PER_TILE = (\d+);", avx2)[1]))
    doc = quoted("docs/engine.md", r"Register tiles: AVX512 up to (\d+) rows x (\d+) panels; AVX2 (\d+) rows "
                                   r"\(float32\) or (\d+) rows \(bfloat16\) x (\d+) panel")
    assert tuple(map(int, doc)) == kernel


def test_the_dtype_bounds_the_docs_quote_are_the_tests():
    bounds = constants(REPO / "tests" / "test_dtype_accuracy.py")
    rows = {"largest logit error of a forward": "MAX_LOGIT_ERROR", "mean logit error": "MEAN_LOGIT_ERROR",
            "held-out perplexity, relative to float32's": "PERPLEXITY_RATIO_ERROR",
            "prompts whose first 16 greedy tokens equal float32's": "GREEDY_EQUAL_SHARE",
            "float32's logit gap wherever the greedy tokens part": "NEAR_TIE"}
    for row, name in rows.items():
        cells = quoted("docs/reliability.md", rf"\| {re.escape(row)} \| ([^|]+) \| ([^|]+) \|")
        doc = [float(m[1]) / (100 if m[2] else 1) for m in (re.search(r"([\d.]+)(%?)", c) for c in cells)]
        assert doc == pytest.approx([bounds[name]["bfloat16"], bounds[name]["float16"]]), row


def test_the_whatif_targets_and_verdicts_the_docs_quote_are_the_benchmarks():
    targets = constants(REPO / "benchmarks" / "whatif.py")["TARGETS"]
    table = {"held-out steps": "step_median_error", "capacity": "capacity_error", "30% load": "workload_error",
             "60% load": "workload_error", "85% load": "workload_error"}
    for row, key in table.items():
        target, = quoted("docs/whatif.md", rf"\| {re.escape(row)}[^|]*\|[^|]*\| ≤ (\d+)% \|")
        assert int(target) / 100 == targets[key], row
    capacity = r"capacity[^;]*? under-predicted by ([\d.]+)% \(target (\d+)%: (met|missed)\)"
    for name in ("README.md", "docs/benchmarks.md"):
        error, target, word = quoted(name, capacity)
        assert int(target) / 100 == targets["capacity_error"] and (float(error) <= int(target)) == (word == "met")


def test_the_simulation_options_the_docs_list_are_its_fields():
    tree = ast.parse((REPO / "runner_core" / "simulator" / "simulation.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Simulation")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    signature, = quoted("docs/whatif.md", r"`Simulation\(([^)]*)\)`")
    listed = {arg.split("=")[0].strip() for arg in signature.split(",")}
    assert listed == fields, f"docs/whatif.md's Simulation(...) lists {sorted(listed)}; its fields are {sorted(fields)}"


def test_the_readme_states_greedy_parity_in_the_dtype_the_parity_test_runs():
    dtype, = quoted("README.md", r"In (\w+), greedy output equals transformers' `generate\(do_sample=False\)` token "
                                 r"for token")
    assert f'"dtype": "{dtype}"' in (REPO / "tests" / "test_parity.py").read_text(encoding="utf-8")
    quoted("README.md", r"in bfloat16 it [^.]*within the bounds of \[docs/reliability\.md\]")


def test_the_sweeps_warm_up_share_is_its_seconds_over_the_wall_time():
    wall, warm, share = quoted("docs/benchmarks.md", r"36 runs, (\d+) s;.*?the warm-ups, which that overhead counts "
                                                     r"as runs, took (\d+) s more \((\d+)% of the wall time\)")
    assert round(100 * int(warm) / int(wall)) == int(share)
    assert quoted("README.md", r"in (\d+) s, [\d.]+% of it in setting changes and (\d+)% in warm-ups") == (wall, share)
