"""A non-editable install ships everything the native kernels' build reads: the package is built
from a copy of the sources and installed into a folder of its own (on top of this environment's
torch), then a process started outside the repository imports it from there and builds the
kernels from the installed files into an empty cache. A missing source or header would leave that
install on the slow torch paths (the build fails, the runner falls back with a warning)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

CHECK = textwrap.dedent("""
    import json, sys
    import runner_core
    from runner_core import kernels
    from runner_core.kernels import build
    ok = kernels.cpu_kernels_available()
    files = [str(p) for p in (build.DISPATCH, build.TIER_SOURCE, *build.HEADERS)]
    print(json.dumps({"package": runner_core.__file__, "kernels": ok, "files": files,
                      "why": kernels._state.get("why"), "tiers": list(kernels.kernel_tiers())}))
""")


def test_installed_package_builds_its_kernels(tmp_path):
    src, target, cache = tmp_path / "src", tmp_path / "site", tmp_path / "cache"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("runner_core", "workbench"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(target), str(src)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target), "RUNNER_WORKBENCH_CACHE": str(cache)}
    for name in ("RUNNER_CORE_NO_KERNELS", "CI"):  # the fallback must be seen, not raised or forced
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["package"].startswith(str(target)), found  # the installed copy, not the checkout
    assert found["kernels"], f"the installed package fell back to the torch paths: {found['why']}"
    assert all(f.startswith(str(target)) for f in found["files"]), found["files"]
    assert found["tiers"][0] == "plain", found["tiers"]  # every build has the plain tier
    assert any((cache / "kernels").glob("*/runner_core_cpu_kernels.so")), "the kernels were not built into the cache"
