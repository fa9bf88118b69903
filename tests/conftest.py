"""Session-wide test settings: a preset cache inside the repo, few CPU threads, the tiny preset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Set before any test builds a preset; subprocesses (workers, notebooks) inherit it.
os.environ["RUNNER_WORKBENCH_CACHE"] = str(REPO / "test-output" / "cache")
# dtype="auto" is float32 on every CPU in the tests (bfloat16 where the CPU has native bf16 matmuls
# otherwise), so the tests run alike on every machine; tests of the choice itself unset it.
os.environ["RUNNER_CORE_CPU_BF16"] = "0"
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    from runner_core.models.presets import ensure_preset

    return ensure_preset("tiny-llama")
