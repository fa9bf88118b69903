"""The served dashboard is safe to expose: loopback by default, any other address only behind a login,
the path box loads only from its model roots, and no pickle is ever loaded by the package."""

from __future__ import annotations

import ast
import http.cookiejar
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.dashboard_server import served_dashboard

REPO = Path(__file__).resolve().parents[1]


def test_a_network_address_without_a_login_is_refused():
    res = subprocess.run([sys.executable, "-m", "workbench", "serve", "--port", "0", "--address", "0.0.0.0"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "exposes the dashboard" in res.stderr and "--basic-auth PASSWORD" in res.stderr


def test_a_network_address_with_basic_auth_asks_for_the_password():
    with served_dashboard("--address", "0.0.0.0", "--basic-auth", "s3cret-pass") as url:
        port = urllib.parse.urlparse(url).port
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/", timeout=60) as resp:  # follows the redirect to the login page
            page = resp.read().decode()
        assert "/login" in resp.url and 'type="password"' in page and "runner-workbench" not in page
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        wrong = urllib.parse.urlencode({"username": "me", "password": "wrong"}).encode()
        with opener.open(base + "/login", data=wrong, timeout=60) as resp:
            assert "runner-workbench</title>" not in resp.read().decode()
        right = urllib.parse.urlencode({"username": "me", "password": "s3cret-pass"}).encode()
        with opener.open(base + "/login", data=right, timeout=60) as resp:
            assert "<title>runner-workbench</title>" in resp.read().decode()


@pytest.fixture
def session():
    from workbench import Session

    s = Session()
    yield s
    s.close()


def test_the_path_box_loads_only_from_the_model_roots(session, tiny_llama_path, tmp_path):
    from workbench.runtime.model_roots import ModelRoots
    from workbench.views.panel_app import SessionDashboard

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(tiny_llama_path, outside / "model")
    allowed.mkdir()
    (allowed / "escape").symlink_to(outside / "model")  # a link inside a root to a folder outside it
    dash = SessionDashboard(session, model_roots=ModelRoots([allowed]))
    for path in (outside / "model", allowed / "escape", allowed / ".." / "outside" / "model"):
        dash.model_path.value = str(path)
        dash.on_load()
        assert dash.error.visible and "is outside the folders this dashboard loads models from" in dash.error.object
        assert "--model-root DIR" in dash.error.object and not session.models
    shutil.copytree(tiny_llama_path, allowed / "model")
    dash.model_path.value = str(allowed / "model")
    dash.on_load()
    assert not dash.error.visible
    assert session.wait_idle(timeout=120) and str((allowed / "model").resolve()) in session.models
    dash.model_path.value = ""
    dash.model_select.value = "tiny-llama"  # presets are always allowed
    dash.on_load()
    assert not dash.error.visible


PICKLE_CALLS = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
                ("numpy", "load"), ("np", "load"), ("joblib", "load"), ("dill", "load")}


def test_no_pickle_loads_in_the_package():
    """No torch.load / pickle / np.load (allow_pickle) call anywhere in runner_core or workbench."""
    found = []
    for path in sorted((REPO / "runner_core").rglob("*.py")) + sorted((REPO / "workbench").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in PICKLE_CALLS:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n in ("pickle", "cPickle", "dill", "joblib") for n in names):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports a pickle module")
    assert not found, found
