"""The teaching notebooks execute top to bottom with a real Jupyter kernel (nbclient + ipykernel).

Each notebook may have a check in CHECKS (its file name -> a function of the executed notebook)
asserting what its lesson shows; every notebook must run without an error output, and the saved
copies in the repository carry no outputs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _stream_text(nb) -> str:
    return "\n".join(o.get("text", "") for o in _outputs(nb) if o.output_type == "stream")


def _mime_kinds(nb) -> set[str]:
    return {k for o in _outputs(nb) for k in o.get("data", {})}


def check_quickstart(nb) -> None:
    text = _stream_text(nb)
    assert "refused: SamplingParams.max_tokens got 0" in text
    assert "tokens generated" in text and "freed_bytes" in text
    kinds = _mime_kinds(nb)
    assert "application/vnd.plotly.v1+json" in kinds  # the charts
    assert "application/vnd.jupyter.widget-view+json" in kinds  # SessionWidgets(session)
    assert "application/vnd.holoviews_exec.v0+json" in kinds  # SessionDashboard(session).inline()


def check_compile_tuning(nb) -> None:
    text = _stream_text(nb)
    assert "greedy tokens equal: True" in text and "recompiles after warm-up: 0" in text
    predicted, measured = re.search(r"predicted ([\d.]+) MiB, measured ([\d.]+) MiB", text).groups()
    assert predicted == measured and float(measured) > 0
    assert "aoti.pt2" in text and "decode-1.pt2" in text  # the packages in the cache folder


CHECKS = {
    "01-quickstart.ipynb": check_quickstart,
    "02-compile-tuning.ipynb": check_compile_tuning,
}


def test_every_notebook_has_a_check():
    assert sorted(CHECKS) == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_saved_notebook_has_no_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    assert not [c for c in nb.cells if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tiny_llama_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits the environment (the test preset cache set by conftest) and runs in a
    # folder under test-output, where the notebook's compile cache stays warm between runs.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    workdir = REPO / "test-output" / "notebooks"
    workdir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    client.execute()
    errors = [o for o in _outputs(nb) if o.output_type == "error"]
    assert not errors
    CHECKS[path.name](nb)
