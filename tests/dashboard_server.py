"""`python -m workbench serve` for the tests, as a user starts it: the URL it prints, and the server
stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import stop

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def served_dashboard(*args: str, wait_s: float = 180) -> Iterator[str]:
    """Serve the dashboard on a free port with the CLI's `args`; yields the URL it prints."""
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--port", "0", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    lines: list[str] = []
    url: list[str] = []
    found = threading.Event()

    def read():  # keeps draining the server's output, so it never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"Workbench dashboard: (http://\S+)", line)
            if m and not url:
                url.append(m.group(1))
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(wait_s):
            pytest.fail("the server printed no URL:\n" + "".join(lines))
        yield url[0]
    finally:
        stop(proc, 15)
