"""`python -m runner_core generate` works end to end and reports errors without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner_core", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_json_for_two_prompts(tiny_llama_path):
    res = _cli("--model", "tiny-llama", "--prompt", "Hello", "--prompt", "Bonjour", "--max-tokens", "7", "--json")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello", "Bonjour"]
    assert all(len(x["token_ids"]) <= 7 and x["finish_reason"] in ("stop", "length") for x in lines)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    res = _cli("--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert res.returncode == 2
    assert "(no such directory)" in res.stderr and "nope" in res.stderr and "Traceback" not in res.stderr


def _tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner_core", "tune", *args], capture_output=True, text=True,
                          timeout=300)


def test_tune_sweeps_and_resumes_from_its_results_file(tiny_llama_path, tmp_path):
    """A sweep from the command line: every point measured (repeats x points rows in the CSV), a
    recommendation; the same command again resumes from the file and measures nothing new."""
    results = tmp_path / "sweep.csv"
    args = ("--model", "tiny-llama", "--dtype", "float32", "--kv-cache-mib", "8", "--requests", "4",
            "--output-len", "4,8", "--concurrency", "1,4", "--max-num-seqs", "2", "--repeats", "2",
            "--results", str(results), "--json")
    first = _tune(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout.splitlines()[-1])
    labels = [p["label"] for p in out["points"]]
    assert labels == ["concurrency=1", "concurrency=4", "concurrency=4 max_num_seqs=2"] or \
        labels == ["concurrency=1", "concurrency=4", "concurrency=1 max_num_seqs=2"]
    assert out["recommendation"]["label"] in labels and "recommended:" in first.stdout
    assert len(results.read_text().splitlines()) == 1 + 3 * 2  # a header and a row per point x repeat
    again = _tune(*args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["timings"]["measured_repeats"] == 0
    assert len(results.read_text().splitlines()) == 1 + 3 * 2


def test_tune_refuses_a_bad_target_naming_the_form():
    res = _tune("--model", "tiny-llama", "--target", "latency<=100")
    assert res.returncode == 2 and "tpot_p99_ms<=100" in res.stderr and "Traceback" not in res.stderr
