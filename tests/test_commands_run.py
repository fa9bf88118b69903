"""Every command the docs name runs from a fresh clone, as a user types it.

Each benchmark script runs in a subprocess from the repository root, through its `make` target where it
has one (`make bench-memory ARGS=...`), in its smallest mode on a tiny preset, to the one JSON line every
benchmark ends with. The targets that need a peer's venv or a GPU are run here too, and must say what
they need without a traceback. The servers `make run` and `make lab` must answer on their port. The
full-size runs (`make bench`, `make binder-check`, ...) are what the note of a change measures.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.doc_commands import REPO, makefile_targets

pytestmark = pytest.mark.slow
TINY = "tiny-llama"
# script: (its make target, or None where it has none; the options of its smallest run)
SMOKE = {
    "benchmarks/throughput.py": (None, ["--quick", "--model", TINY, "--skip-hf", "--skip-vllm", "--skip-compiled",
                                        "--repeats", "1", "--kv-cache-gib", "1"]),
    "benchmarks/kv_waste.py": ("bench-memory", ["--quick", "--model", TINY, "--num-requests", "4",
                                                "--prefix-requests", "4"]),
    "benchmarks/session_poll.py": ("bench-poll", ["--rounds", "1", "--calls", "20", "--requests", "4"]),
    "benchmarks/contention.py": ("bench-contention", ["--models", "tiny-speaker", "--requests", "2", "--rounds", "1",
                                                      "--settings", "adaptive"]),
    "benchmarks/profile_step.py": (None, ["--model", TINY, "--formats", "fp32", "int8"]),
    "benchmarks/load_memory.py": (None, ["--models", TINY, "--dtypes", "float32"]),
    "benchmarks/parallel.py": ("bench-parallel", ["--quick", "--model", TINY, "--requests", "2"]),
    "benchmarks/models.py": ("bench-models", ["--quick", "--sections", "fallback", "--model", TINY,
                                              "--num-requests", "2", "--repeats", "1", "--hf-single-requests", "1"]),
    "benchmarks/quant.py": ("bench-quant", ["--quick", "--formats", "none", "int8", "--mixed-formats", "int8",
                                            "--repeats", "1", "--decode-tokens", "8", "--mixed-requests", "2",
                                            "--ppl-paragraphs", "4"]),
    "benchmarks/serve.py": ("bench-serve", ["--quick", "--no-peer", "--no-sweep", "--repeats", "1",
                                            "--num-prompts", "4", "--input-len", "16", "--output-len", "8"]),
    "benchmarks/native_kernels.py": ("bench-kernels", ["--tiers", "avx2", "--sections", "gemm,attention",
                                                       "--models", "small-llama", "--rows", "1", "--repeats", "3",
                                                       "--contexts", "64", "--dtypes", "float32", "--threads", "1"]),
    "benchmarks/whatif.py": ("bench-whatif", ["--no-published", "--model", TINY, "--second-model", TINY,
                                              "--repeats", "1", "--num-requests", "4"]),
    "benchmarks/compile.py": ("bench-compile", ["--quick", "--scopes", "layer", "--num-requests", "2",
                                                "--rounds", "1"]),
    "benchmarks/ab_revisions.py": (None, ["HEAD", "HEAD", "--rounds", "1", "--model", TINY]),
    "benchmarks/structured_outputs.py": (None, ["--model", TINY, "--repeats", "1", "--max-tokens", "8", "--seeds", "1",
                                                "--schema-max-tokens", "64"]),
    "benchmarks/parallel_sampling.py": (None, ["--model", TINY, "--repeats", "1", "--max-tokens", "8"]),
    "benchmarks/spec_decode.py": (None, ["--models", TINY, "--ks", "1", "2", "--repeats", "1", "--max-tokens", "8",
                                         "--draft", TINY, TINY, "--draft-batch", "2",
                                         "--verify-model", TINY, "--verify-context", "16", "--verify-calls", "1"]),
}
# the same variables each target reads, pointed at the tiny preset and this run's folders
MAKE_VARS = {"bench-quant": {"BENCH_MODELS": TINY}, "bench-serve": {"SWEEP_MODEL": TINY}}
# script: (its make target or None, what its message must name where that is missing)
NEEDS = {
    "benchmarks/cuda_graphs.py": ("bench-cuda-graphs", "CUDA"),
    "benchmarks/gpu_check.py": ("gpu-check", "CUDA"),
    "benchmarks/llamacpp_peer.py": (None, "make bench-llamacpp-peer"),
}
INTERNAL = {"benchmarks/engine_proc.py", "benchmarks/quant_proc.py"}  # started by the other scripts


def make(target: str, args: list[str], tmp: Path, extra: dict[str, str] | None = None) -> list[str]:
    """`make TARGET ARGS=...` with this venv and its setup taken as done (make test has just done it)."""
    venv = Path(sys.prefix)
    variables = {"VENV": str(venv), "PY": sys.executable, "GPU_PYTHON": sys.executable,
                 "SWEEP_RESULTS": str(tmp / "sweep.csv"),
                 **(extra or {}), "ARGS": " ".join(args)}
    return ["make", "--no-print-directory", "-o", str(venv / ".installed"), target,
            *[f"{k}={v}" for k, v in variables.items()]]


def command(script: str, target: str | None, args: list[str], tmp: Path) -> list[str]:
    return make(target, args, tmp, MAKE_VARS.get(target)) if target else [sys.executable, script, *args]


def run(cmd: list[str], tmp: Path, timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_every_benchmark_script_is_in_the_smoke_run():
    scripts = {p.relative_to(REPO).as_posix() for p in REPO.glob("benchmarks/*.py")
               if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)}
    assert scripts == set(SMOKE) | set(NEEDS) | INTERNAL
    targets = makefile_targets()
    for script, (target, _) in {**SMOKE, **NEEDS}.items():
        assert target is None or any(script in line for line in targets[target]), (target, script)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_a_benchmark_runs_to_its_json_line(script, tmp_path):
    target, args = SMOKE[script]
    proc = run(command(script, target, args, tmp_path), tmp_path)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert isinstance(json.loads(last), dict), f"{script}'s last line is not its JSON figures: {last[:300]}"


@pytest.mark.parametrize("script", sorted(NEEDS))
def test_a_benchmark_that_needs_what_is_missing_says_so(script, tmp_path):
    target, need = NEEDS[script]
    if need == "CUDA":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible: make gpu-check is what runs there")
    proc = run(command(script, target, ["--model", TINY] if script.endswith("llamacpp_peer.py") else [], tmp_path),
               tmp_path, timeout=120)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and need in said and "Traceback" not in said, said[-3000:]


def test_a_benchmark_option_out_of_its_choices_is_refused_naming_them(tmp_path):
    proc = run(command("benchmarks/contention.py", "bench-contention", ["--settings", "adaptive,sleepy"], tmp_path),
               tmp_path, timeout=120)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "--settings: unknown ['sleepy']; choose of" in said and "Traceback" not in said


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serves(cmd: list[str], url: str, tmp: Path, timeout: float = 180) -> None:
    """Starts a server command, waits for its page to answer 200, stops it (its whole process group)."""
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline, status = time.monotonic() + timeout, None
        while time.monotonic() < deadline and proc.poll() is None and status != 200:
            try:
                status = urllib.request.urlopen(url, timeout=10).status
            except OSError:
                time.sleep(0.5)
        log.flush()
        assert status == 200, f"{' '.join(cmd)} did not serve {url}:\n{(tmp / 'server.log').read_text()[-3000:]}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
                break
            except ProcessLookupError:  # the group has gone
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def test_make_run_serves_the_dashboard(tmp_path):
    port = _free_port()
    cmd = make("run", [], tmp_path, {"MODEL": TINY, "PORT": str(port)})
    _serves(cmd, f"http://127.0.0.1:{port}/", tmp_path)


def test_make_lab_serves_jupyterlab(tmp_path):
    port = _free_port()
    args = ["--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=",
            f"--ServerApp.root_dir={REPO / 'notebooks'}"]
    _serves(make("lab", args, tmp_path), f"http://127.0.0.1:{port}/lab", tmp_path)


def test_make_generate_prints_a_generation(tmp_path):
    proc = run(make("generate", [], tmp_path, {"MODEL": "tiny-speaker", "PROMPT": "The function returns"}), tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]


def test_make_sweep_runs_a_small_sweep(tmp_path):
    args = ["--requests", "2", "--concurrency", "1", "--max-num-seqs", "4", "--prompt-len", "8", "--output-len", "4",
            "--repeats", "1", "--warmup", "0", "--json"]
    proc = run(make("sweep", args, tmp_path, {"SWEEP_MODEL": TINY}), tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert isinstance(json.loads(proc.stdout.strip().splitlines()[-1]), dict)
    assert (tmp_path / "sweep.csv").is_file()


@pytest.mark.parametrize("target", ["bench", "binder-check", "bench-peers", "bench-llamacpp-peer", "soak", "fuzz",
                                    "preset", "lesson-screenshots", "test", "clean"])
def test_a_target_too_long_or_too_wide_for_the_suite_expands_to_commands_that_exist(target, tmp_path):
    """A dry run (`make -n`): the recipe expands, and each script it names exists (their options are
    checked against the docs by tests/test_doc_commands.py)."""
    proc = subprocess.run([*make(target, [], tmp_path), "-n"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for script in re.findall(r"\b((?:benchmarks|binder|tests)/[\w./-]+\.py)\b", proc.stdout):
        assert (REPO / script).is_file(), f"make {target} runs {script}, which does not exist"
