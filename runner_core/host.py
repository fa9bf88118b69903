"""This machine and this code, as a measured record names them: the CPU's model name, the tier runner_core's
native kernels run on it, and the git commit of the source runner_core runs from."""

from __future__ import annotations

import contextlib
import functools
import platform
import subprocess
from pathlib import Path

import torch

from runner_core.config import project_version
from runner_core.kernels import cpu_kernels_available, kernel_tier


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_tier() -> str:
    """runner_core's native kernel tier, else torch's CPU capability."""
    return kernel_tier() if cpu_kernels_available() else torch.backends.cpu.get_cpu_capability().lower()


def machine_name() -> str:
    """The CPU's model name and tier: "AMD EPYC (avx512-bf16)"."""
    return f"{cpu_model_name()} ({cpu_tier()})"


@functools.cache
def source_commit() -> str:
    """The commit (40 hex digits) of the git checkout this process's runner_core was imported from, read
    once: the code it runs; "runner-workbench <version>" when runner_core is not a checkout's (an installed
    package). Uncommitted changes are not told apart."""
    package = Path(__file__).resolve().parent
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", str(package), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=30)
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() / "runner_core" == package:
            return lines[1]
    return f"runner-workbench {project_version()}"
