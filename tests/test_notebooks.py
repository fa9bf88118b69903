"""The teaching notebooks execute top to bottom with a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


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
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                     if o.output_type == "stream")
    if path.name == "02-compile-tuning.ipynb":
        import re

        assert "greedy tokens equal: True" in text and "recompiles after warm-up: 0" in text
        predicted, measured = re.search(r"predicted ([\d.]+) MiB, measured ([\d.]+) MiB", text).groups()
        assert predicted == measured and float(measured) > 0
        assert "aoti.pt2" in text and "decode-1.pt2" in text  # the packages in the cache folder
    if path.name == "01-quickstart.ipynb":
        assert "refused: SamplingParams.max_tokens got 0" in text
        assert "tokens generated" in text and "freed_bytes" in text
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        kinds = {k for o in outputs for k in o.get("data", {})}
        assert "application/vnd.plotly.v1+json" in kinds  # the charts
        assert "application/vnd.jupyter.widget-view+json" in kinds  # SessionWidgets(session)
        assert "application/vnd.holoviews_exec.v0+json" in kinds  # SessionDashboard(session).inline()
