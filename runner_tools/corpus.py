"""The training corpus of `tiny-speaker`: English prose from the docstrings of the Python standard
library on this machine (PSF License), built offline and deterministically.

Files are read in sorted order, test packages and site-packages left out; each docstring is split
into paragraphs, reST markup is unwrapped (``x``, :func:`x`, *x*), and a paragraph is kept only if it
reads as prose: no doctest or code line, no field list or directive, no identifier-like characters,
at least a few words, a capital first letter and a final full stop. Exact duplicates are dropped.
"""

from __future__ import annotations

import ast
import re
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

WORDS_FILE = "corpus_words.txt"  # saved beside the model: the corpus's words, one a line
LICENCE = "PSF License (Python Software Foundation License Version 2)"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`name`, :ref:`text <target>`
_LITERAL = re.compile(r"``([^`]*)``|`([^`]*)`")
_EMPHASIS = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_CODE_CHARS = re.compile(r"[_=<>{}\[\]\\|#@$~^`*]|\(\)|\w\.\w|\w\(")
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\.\. |:\w|[-*+] |\d+[.)] |[=\-~^]{3,}|def |class |import |from \S+ import)")
_WORD = re.compile(r"[A-Za-z]+")


def stdlib_dir() -> Path:
    """The standard library of the Python running this: the corpus source."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The standard library's .py files under `root`, sorted, tests and third-party packages left out."""
    return sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def docstrings(path: Path) -> Iterator[str]:
    """The module, class and function docstrings of one source file (none if it does not parse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def prose_paragraphs(doc: str) -> Iterator[str]:
    """The paragraphs of a docstring that read as plain English prose, each on one line."""
    for block in re.split(r"\n\s*\n", doc):
        lines = block.splitlines()
        if not lines or any(_CODE_LINE.match(line) or line.startswith("    ") for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        text = _ROLE.sub(r"\1", text)
        text = _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)
        text = _EMPHASIS.sub(r"\1", text)
        text = re.sub(r"\s+", " ", text).strip()
        words = text.split()
        if (len(words) >= 6 and text[0].isupper() and text.endswith(".") and text.isascii()
                and not _CODE_CHARS.search(text)
                and sum(bool(_WORD.fullmatch(w.strip(".,;:!?()'\""))) for w in words) >= 0.8 * len(words)):
            yield text


def build_corpus(root: Path | None = None) -> list[str]:
    """The de-duplicated prose paragraphs of the standard library under `root`, in a fixed order."""
    seen: dict[str, None] = {}
    for path in source_files(root or stdlib_dir()):
        for doc in docstrings(path):
            for paragraph in prose_paragraphs(doc):
                seen.setdefault(paragraph, None)
    return list(seen)


def corpus_words(paragraphs: list[str]) -> set[str]:
    """The lower-cased alphabetic words of the corpus: the word list its greedy text is checked against."""
    return {w.lower() for p in paragraphs for w in _WORD.findall(p)}
