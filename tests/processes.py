"""Stopping the server processes the browser tests start."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """Terminate `proc`; kill it if it has not exited after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
