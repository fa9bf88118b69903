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
    assert "model directory not found" in res.stderr and "Traceback" not in res.stderr
