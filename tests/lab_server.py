"""A `jupyter lab` server for the browser tests: loopback, a free port, a random token, a root
folder of the caller's, and settings of its own (no news or update pop-ups, every cell kept in the
page so that the tests can read them all), started with the test environment so that its kernels
import this checkout."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.processes import stop

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120  # a cold start on a busy 2-core machine

# JupyterLab settings overrides (one file per plugin) for the server's own settings folder.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
    # "none": every cell stays in the DOM (the default windowing drops cells scrolled out of view)
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


@dataclass
class LabServer:
    url: str  # ends with "/"
    token: str
    root: Path
    runtime: Path  # the kernels' connection files

    def notebook_url(self, name: str) -> str:
        return f"{self.url}lab/tree/{name}?token={self.token}&reset"

    def _sessions(self, name: str) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}api/sessions?token={self.token}", timeout=10) as response:
            return [s for s in json.load(response) if s["path"] == name]

    def shut_down(self, name: str) -> None:
        """End the notebook's session and its kernel: a finished lesson's kernel otherwise stays, its dashboards
        refreshing, and takes CPU from the lessons after it."""
        for session in self._sessions(name):
            request = urllib.request.Request(f"{self.url}api/sessions/{session['id']}?token={self.token}",
                                             method="DELETE")
            urllib.request.urlopen(request, timeout=60).close()

    @contextlib.contextmanager
    def kernel_client(self, name: str):
        """A second client (beside the page's) of the kernel that runs the notebook `name`."""
        from jupyter_client import BlockingKernelClient

        kernels = [s["kernel"]["id"] for s in self._sessions(name)]
        if len(kernels) != 1:
            raise RuntimeError(f"expected one kernel for {name}, the server runs {len(kernels)}")
        client = BlockingKernelClient(connection_file=str(self.runtime / f"kernel-{kernels[0]}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=30)
            yield client
        finally:
            client.stop_channels()


CHROMIUM = "/usr/bin/chromium"


def missing_tools() -> list[str]:
    """What the JupyterLab browser test lacks here (empty when it can run)."""
    import importlib.util

    return [what for what, found in (
        (f"{CHROMIUM} (`apt-get install -y chromium`)", Path(CHROMIUM).exists()),
        ("jupyterlab (`pip install -e '.[ui]'`)", importlib.util.find_spec("jupyterlab")),
        ("playwright (`pip install -e '.[test]'`)", importlib.util.find_spec("playwright"))) if not found]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_settings(folder: Path) -> None:
    for name, values in SETTINGS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.5)  # ends early when the server dies
    raise RuntimeError(f"jupyter lab did not answer {url} within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def lab_server(root: Path, state: Path) -> Iterator[LabServer]:
    """`jupyter lab` serving `root`; its settings, workspaces, runtime files and log live in `state`."""
    settings, log, runtime = state / "settings", state / "lab.log", state / "runtime"
    _write_settings(settings)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(runtime), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
           "jupyterlab.NeverCheckForUpdate"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        _wait_ready(proc, f"{url}api/status?token={token}", log)
        yield LabServer(url, token, root, runtime)
    finally:
        stop(proc, 20)
