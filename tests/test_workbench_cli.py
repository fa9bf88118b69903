"""`python -m workbench serve`: binds loopback, prints its URL, loads --model first, and reports a
bad model as a one-line error."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_serve_with_a_model_prints_a_loopback_url(tiny_llama_path):
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--port", "0", "--model", "tiny-llama"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"Workbench dashboard: (http://\S+)", line)
            if m:
                break
        else:
            raise AssertionError("no URL printed:\n" + "".join(seen))
        assert any(line.startswith("loaded tiny-llama in") for line in seen), seen
        url = m.group(1)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
        with urllib.request.urlopen(url, timeout=60) as resp:
            page = resp.read().decode()
        assert resp.status == 200 and "<title>runner-workbench</title>" in page
    finally:
        proc.terminate()
        proc.wait(15)


def test_serve_with_a_missing_model_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "workbench", "serve", "--port", "0", "--model", str(tmp_path / "nope")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "error: model directory not found" in res.stderr and "Traceback" not in res.stderr
