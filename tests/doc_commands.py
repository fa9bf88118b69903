"""The commands a user reads: those in the docs' code, the Makefile's targets and recipes, each parsed."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "ARCHITECTURE.md", *REPO.glob("docs/*.md"),
               *REPO.glob("binder/*.md")])
# how a command starts; what follows a Python interpreter must be a project script or module
_PYTHON = re.compile(r"^(?:\S*/)?python3?$")
_CLIS = {"runner-core": "runner_core", "runner-workbench": "workbench"}
PROJECT_MODULES = ("runner_core", "workbench")


@dataclass(frozen=True)
class Command:
    """One command as a user would type it: `make` with a target, or a project script or module."""

    source: str  # "README.md:12"
    text: str
    make_target: str | None = None
    make_vars: tuple[str, ...] = ()
    script: str | None = None  # "benchmarks/throughput.py"
    module: str | None = None  # "runner_core" for `python -m runner_core ...` and `runner-core ...`
    words: tuple[str, ...] = ()  # subcommands before the first option (`serve`, `tune`)
    options: tuple[str, ...] = ()  # the `--flags` shown


def code_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each fenced block's lines and each inline code span (a span may cross a line)."""
    text = path.read_text()
    out, prose, fenced = [], [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced:
            out.append((no, line))
            prose.append("")
        else:
            prose.append(line)
    joined = "\n".join(prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        out.append((joined.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")))
    return out


def parse(source: str, text: str) -> list[Command]:
    """The commands in one line of code (`&&`, `;` and `|` separate them; `#` starts a comment)."""
    text = re.sub(r"(^|\s)#.*", "", text)
    cmds = []
    for part in re.split(r"&&|;|\|\|?", text):
        try:
            words = shlex.split(part.replace("[", " ").replace("]", " "))
        except ValueError:  # an unclosed quote across a span: take the words as they are
            words = part.replace("[", " ").replace("]", " ").split()
        while words and (words[0] in ("$", "env", "cd") or _is_assignment(words[0])):
            words = words[2:] if words[0] == "cd" else words[1:]
        if not words:
            continue
        cmd = _command(source, part.strip(), words)
        if cmd is not None:
            cmds.append(cmd)
    return cmds


def _is_assignment(word: str) -> bool:
    return re.match(r"[A-Za-z_][A-Za-z0-9_]*=", word) is not None


def _command(source: str, text: str, words: list[str]) -> Command | None:
    head, rest = words[0], words[1:]
    if head == "make":
        targets = [w for w in rest if not w.startswith("-") and not _is_assignment(w)]
        if len(targets) != 1 or not re.fullmatch(r"[a-z][a-z0-9-]*", targets[0]):
            return None  # prose ("make it"), or a target list
        variables = tuple(w.split("=", 1)[0] for w in rest if _is_assignment(w))
        return Command(source, text, make_target=targets[0], make_vars=variables)
    if head in _CLIS:
        return _with_options(Command(source, text, module=_CLIS[head]), rest)
    if not _PYTHON.match(head) or not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1 and rest[1].split(".")[0] in PROJECT_MODULES:
        return _with_options(Command(source, text, module=rest[1]), rest[2:])
    if rest[0].endswith(".py") and (REPO / rest[0]).parent.exists() and not rest[0].startswith("-"):
        return _with_options(Command(source, text, script=rest[0]), rest[1:])
    return None


def _with_options(cmd: Command, rest: list[str]) -> Command:
    words = []
    for w in rest:
        if w.startswith("-"):
            break
        words.append(w)
    options = tuple(sorted({re.match(r"--[a-z0-9][a-z0-9-]*", w).group(0) for w in rest
                            if re.match(r"--[a-z0-9]", w)}))
    return Command(cmd.source, cmd.text, script=cmd.script, module=cmd.module, words=tuple(words), options=options)


def doc_commands() -> list[Command]:
    """Every project command in the docs' code: README.md, CONTRIBUTING.md, ARCHITECTURE.md, docs/, binder/."""
    cmds = []
    for path in DOCS:
        for no, text in code_texts(path):
            cmds.extend(parse(f"{path.relative_to(REPO)}:{no}", text))
    return cmds


def makefile_targets(makefile: Path = REPO / "Makefile") -> dict[str, list[str]]:
    """Each explicit target of the Makefile with its recipe's lines (continuations joined)."""
    targets, current = {}, None
    lines = makefile.read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        m = re.match(r"^([A-Za-z0-9_.$()/-]+):(?!=)", line)
        if m and not line.startswith("\t") and not m.group(1).startswith("."):
            current = m.group(1)
            targets[current] = []
        elif line.startswith("\t") and current is not None:
            targets[current].append(line.strip())
        elif line.strip() and not line.startswith("#"):
            current = None
    return {t: r for t, r in targets.items() if "$" not in t and "/" not in t}


def makefile_variables(makefile: Path = REPO / "Makefile") -> set[str]:
    """The variables the Makefile reads (`$(NAME)`)."""
    return set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", makefile.read_text()))


def recipe_commands() -> list[Command]:
    """The project scripts and modules the Makefile's recipes run (`$(PY) benchmarks/X.py ...`)."""
    cmds = []
    for target, recipe in makefile_targets().items():
        for line in recipe:
            line = re.sub(r"\$\((PY|PYTHON|GPU_PYTHON)\)", "python", line).replace("$$", "$")
            line = re.sub(r"\$\([A-Z_]+:%=([^ %)]*)[^)]*\)", r"\1", line)  # $(MODELS:%=--model %): --model
            for part in re.split(r"&&|;", line):
                part = re.sub(r"^\W*((do|then|else) )?(nice -n \d+ )?", "", part.strip())
                part = re.sub(r"^([A-Z_]+=\S+\s+)+", "", part)  # the recipe's environment (PYTHONPATH=...)
                words = [w for w in part.split() if not w.startswith("$")]
                cmd = _command(f"Makefile:{target}", part, words) if words else None
                if cmd is not None and cmd.make_target is None:
                    cmds.append(cmd)
    return cmds
