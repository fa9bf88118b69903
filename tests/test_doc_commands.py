"""The docs' commands match the code: each `make` target exists and reads the variables shown, each
script and module exists and takes the options shown (README.md, CONTRIBUTING.md, ARCHITECTURE.md,
docs/, binder/, and the Makefile's own recipes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.doc_commands import REPO, Command, doc_commands, makefile_targets, makefile_variables, parse, recipe_commands

# One process asks every script and module for its --help (torch imported once): {key: (exit code, help)}
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for key, kind, target, words in json.loads(sys.argv[1]):
    buf, path = io.StringIO(), list(sys.path)
    sys.argv = [target, *words, "--help"]
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            if kind == "script":
                sys.path.insert(0, target.rsplit("/", 1)[0])
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as exc:
        code = exc.code or 0
    except Exception as exc:
        code = f"{type(exc).__name__}: {exc}"
    finally:
        sys.path[:] = path
    out[key] = [code, buf.getvalue()]
print("HELP-JSON " + json.dumps(out))
"""


def _key(cmd: Command) -> str:
    return " ".join([cmd.script or cmd.module, *cmd.words])


def ask_for_help(cmds: list[Command]) -> dict[str, tuple[object, str]]:
    todo = {_key(c): ("script" if c.script else "module", c.script or c.module, list(c.words))
            for c in cmds if c.script or c.module}
    proc = subprocess.run([sys.executable, "-c", _HELP_DRIVER, json.dumps([[k, *v] for k, v in todo.items()])],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HELP-JSON ")), None)
    assert line is not None, f"the help driver failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return {k: tuple(v) for k, v in json.loads(line[len("HELP-JSON "):]).items()}


def unknown(cmds: list[Command], helps: dict[str, tuple[object, str]]) -> list[str]:
    """What the commands show that the code does not have, one line each."""
    targets, variables = makefile_targets(), makefile_variables()
    wrong = []
    for c in cmds:
        if c.make_target is not None:
            if c.make_target not in targets:
                wrong.append(f"{c.source}: `{c.text}`: the Makefile has no target {c.make_target!r}")
            wrong += [f"{c.source}: `{c.text}`: the Makefile reads no {v}" for v in c.make_vars if v not in variables]
            continue
        if c.script and not (REPO / c.script).is_file():
            wrong.append(f"{c.source}: `{c.text}`: no script {c.script}")
            continue
        code, text = helps[_key(c)]
        if code != 0:
            wrong.append(f"{c.source}: `{c.text}`: `{_key(c)} --help` failed ({code}): {text[-500:]}")
            continue
        wrong += [f"{c.source}: `{c.text}`: {_key(c)} takes no {o}" for o in c.options
                  if not re.search(re.escape(o) + r"(?![a-z0-9-])", text)]
    return wrong


@pytest.fixture(scope="module")
def commands_and_helps():
    cmds = doc_commands() + recipe_commands()
    return cmds, ask_for_help(cmds)


def test_the_docs_show_commands_of_every_kind(commands_and_helps):
    cmds, _ = commands_and_helps
    assert {c.make_target for c in cmds} >= {"run", "test", "bench", "bench-memory", "binder-check"}
    assert {c.script for c in cmds} >= {"benchmarks/throughput.py", "benchmarks/native_kernels.py"}
    assert {(c.module, c.words) for c in cmds} >= {("runner_core", ("generate",)), ("workbench", ("serve",))}


def test_every_documented_command_exists_and_takes_the_options_shown(commands_and_helps):
    cmds, helps = commands_and_helps
    wrong = unknown(cmds, helps)
    assert not wrong, "the docs show commands the code does not have:\n" + "\n".join(wrong)


def test_a_wrong_target_script_variable_or_option_is_reported():
    cmds = [*parse("x.md:1", "make bench-nothing"), *parse("x.md:2", "make test TORCH_SPECS=torch"),
            *parse("x.md:3", "python benchmarks/nothing.py --quick"),
            *parse("x.md:4", "python benchmarks/kv_waste.py --quick --no-such-option"),
            *parse("x.md:5", "python -m runner_core generate --model m --prompt-file f")]
    wrong = unknown(cmds, ask_for_help(cmds))
    assert [w.split(":")[1] for w in wrong] == ["1", "2", "3", "4", "5"], wrong
    assert "--no-such-option" in wrong[3] and "--prompt-file" in wrong[4]


def test_every_benchmark_script_has_a_make_target_or_a_documented_command():
    scripts = {p.relative_to(REPO).as_posix() for p in REPO.glob("benchmarks/*.py")
               if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)}
    shown = {c.script for c in doc_commands() + recipe_commands()}
    internal = {"benchmarks/engine_proc.py", "benchmarks/quant_proc.py", "benchmarks/child.py",
                "benchmarks/llamacpp_peer.py"}  # started by the benchmarks themselves
    assert scripts - internal <= shown, f"not shown anywhere a user reads: {sorted(scripts - internal - shown)}"
