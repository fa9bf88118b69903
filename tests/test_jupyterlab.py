"""The teaching notebooks in JupyterLab in a real browser, as a user runs them: one `jupyter lab`
for the module (tests/lab_server.py) over a copy of notebooks/, Debian's Chromium through
Playwright. For each notebook: Run All, wait until every cell has run and the kernel is idle, then
no error output, widgets rendered as widgets, plotly charts drawn with their traces, the inline
dashboard committing a value typed and confirmed with Enter (read back in the kernel); a screenshot
of its main chart under test-output/screenshots/; then the notebook is saved from JupyterLab (Ctrl+S),
its kernel shut down, and the saved copy passes its lesson's check of tests/test_notebooks.py and stays
small.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.lab_server import CHROMIUM, lab_server, missing_tools
from tests.test_notebooks import CHECKS, NOTEBOOKS, _outputs
from tests.test_workbench_browser import CHROMIUM_ARGS

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "test-output" / "screenshots"
# The server's root: fresh copies of notebooks/ (the saved notebooks are never touched) in the folder
# where tests/test_notebooks.py runs them too, so the compile caches they write there are shared.
LAB_ROOT = REPO / "test-output" / "notebooks"
KERNEL_START_MS = 120_000
RUN_ALL_MS = 900_000  # under 2 minutes warm; with a cold compile on a busy 2-core machine, 8 minutes
STEP_MS = 90_000  # one dashboard action on a busy 2-core machine
SAVED_NOTEBOOK_LIMIT = 3 * 2**20  # bytes: Panel's JavaScript is not kept in the saved outputs; its stylesheets are
# (lesson 01's inline dashboard, three tabs: 2.3 MiB, of which 0.9 MiB is the 65 KB MapLibre sheet each of
# its 14 Plotly panes carries)
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"

# Every code cell's prompt: "[ ]:" not run, "[*]:" queued or running, "[12]:" done.
PROMPTS_JS = "() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]" \
             ".map(p => p.textContent.trim())"
RUN_ALL_STARTED_JS = f"() => ({PROMPTS_JS})().some(t => t !== '[ ]:')"
RUN_ALL_ENDED_JS = f"() => !({PROMPTS_JS})().includes('[*]:')"
# Charts in the notebook's own outputs (not those inside the dashboard or a widget) that hold traces:
# jupyterlab-plotly draws into the output node itself.
DRAWN_CHARTS_JS = ("() => [...document.querySelectorAll('.jp-OutputArea-output.js-plotly-plot')]"
                   ".filter(el => el.data && el.data.length > 0).length")
# The index of the chart whose traces hold the most points.
MAIN_CHART_JS = ("els => els.map(el => (el.data || []).reduce((n, t) => n + (t.x || t.y || t.z || []).length, 0))"
                 ".reduce((best, n, i, all) => n > all[best] ? i : best, 0)")
# An output the widget manager drew holds the widget's view (class jupyter-widgets).
WIDGET_OUTPUTS = ".jp-OutputArea-output:has(> .jupyter-widgets)"
# In the kernel: the max tokens value of every SessionDashboard (the notebook does not name its one).
KERNEL_MAX_TOKENS = ("[d.max_tokens.value for d in __import__('gc').get_objects()"
                     " if type(d).__name__ == 'SessionDashboard']")


def _require_tools():
    missing = missing_tools()
    if missing:
        message = "the JupyterLab browser test needs " + ", ".join(missing) + " (make test installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def lab(tiny_llama_path, tmp_path_factory):
    _require_tools()
    LAB_ROOT.mkdir(parents=True, exist_ok=True)
    for path in NOTEBOOKS:
        shutil.copyfile(path, LAB_ROOT / path.name)
    with lab_server(LAB_ROOT, tmp_path_factory.mktemp("jupyterlab-state")) as server:
        yield server


@pytest.fixture(scope="module")
def browser(lab):
    import playwright.sync_api

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _run_all(page) -> None:
    """Run > Run All Cells, then wait until no cell is queued or running and the kernel is idle."""
    from playwright.sync_api import expect

    kernel = page.locator("#jp-main-statusbar")  # "Python 3 (ipykernel) | Idle"
    expect(kernel).to_contain_text("| Idle", timeout=KERNEL_START_MS)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
    page.wait_for_function(RUN_ALL_STARTED_JS, timeout=STEP_MS)
    page.wait_for_function(RUN_ALL_ENDED_JS, timeout=RUN_ALL_MS, polling=500)
    expect(kernel).to_contain_text("| Idle", timeout=STEP_MS)


def _save(page, path: Path):
    """Ctrl+S in JupyterLab; the saved file, read with nbformat, once the tab is clean."""
    import nbformat
    from playwright.sync_api import expect

    tab = page.locator(".lm-TabBar-tab.jp-mod-current")
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})  # focus the notebook, not an output
    page.keyboard.press("Control+s")
    expect(tab).not_to_have_class(re.compile(r"\bjp-mod-dirty\b"), timeout=STEP_MS)
    return nbformat.read(path, as_version=4)


def _kernel_value(client, expression: str) -> str:
    """`expression` evaluated in the kernel without a trace in the notebook (silent, no history)."""
    reply = client.execute("", silent=True, user_expressions={"value": expression}, reply=True,
                           timeout=STEP_MS / 1000)
    result = reply["content"]["user_expressions"]["value"]
    assert result["status"] == "ok", result
    return result["data"]["text/plain"]


def _check_dashboard_takes_enter(page, kernel) -> None:
    """Max tokens 0 confirmed with Enter reaches Python: Generate is refused with the reason.

    One try. Leaving the field would also commit its value, so the field keeps the focus until the
    kernel holds the value (read there, not in the page); only then is Generate clicked, which makes
    the refusal independent of the order in which the value and the click are handled."""
    from playwright.sync_api import expect

    dashboard = page.locator(".wb-dashboard").first
    expect(dashboard).to_be_visible(timeout=STEP_MS)
    error = dashboard.locator(".wb-error")
    max_tokens = dashboard.locator(".wb-max-tokens input")
    assert _kernel_value(kernel, KERNEL_MAX_TOKENS) == "[64]", "one dashboard, max tokens at its default"
    max_tokens.fill("0")
    max_tokens.press("Enter")
    deadline = time.monotonic() + STEP_MS / 1000
    while (seen := _kernel_value(kernel, KERNEL_MAX_TOKENS)) != "[0]" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert seen == "[0]", f"max tokens 0 + Enter did not reach the kernel (it holds {seen})"
    assert max_tokens.evaluate("el => el === el.getRootNode().activeElement"), "the field kept the focus"
    dashboard.get_by_role("button", name="Generate").click()
    expect(error).to_contain_text("max_tokens got 0", timeout=STEP_MS)


def _screenshot_main_chart(page, name: str) -> None:
    """The notebook's chart with the most points (the whole notebook when it has none)."""
    charts = page.locator(".jp-OutputArea-output.js-plotly-plot")
    if charts.count():
        target = charts.nth(charts.evaluate_all(MAIN_CHART_JS))
    else:
        target = page.locator(".jp-Notebook").first
    target.scroll_into_view_if_needed()
    target.screenshot(path=str(SCREENSHOTS / f"{Path(name).stem}.png"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_in_jupyterlab(path, lab, browser):
    import nbformat

    source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(lab.notebook_url(path.name))
        _run_all(page)
        prompts = page.evaluate(PROMPTS_JS)
        not_run = [i for i, t in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", t)]
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        assert not not_run, (f"Run All stopped: code cells {not_run} did not run; stderr shown:\n"
                             + "\n".join(errors.all_inner_texts())[-3000:])

        output_texts = page.locator(".jp-OutputArea-output").all_inner_texts()
        drawn_widgets = page.locator(WIDGET_OUTPUTS).count()
        drawn_charts = page.evaluate(DRAWN_CHARTS_JS)
        if "SessionDashboard(" in source:
            with lab.kernel_client(path.name) as kernel:  # after Run All: the dashboard still answers
                _check_dashboard_takes_enter(page, kernel)
        _screenshot_main_chart(page, path.name)

        saved_path = lab.root / path.name
        nb = _save(page, saved_path)
    finally:
        page.close()
        lab.shut_down(path.name)
    errors = [f"{o.ename}: {o.evalue}" for o in _outputs(nb) if o.output_type == "error"]
    assert not errors
    widget_outputs = [o for o in _outputs(nb) if WIDGET in o.get("data", {})]
    # a widget output not drawn shows a placeholder or its text repr (the saved text/plain) instead
    fallbacks = {o.data["text/plain"].strip() for o in widget_outputs if o.data.get("text/plain", "").strip()}
    not_drawn = [t[:200] for t in output_texts
                 if "Loading widget" in t or "Error displaying widget" in t or t.strip() in fallbacks]
    assert not not_drawn, "widget outputs not drawn as widgets"
    if "SessionWidgets(" in source:  # (a closed widget, such as a finished progress bar, leaves nothing)
        assert drawn_widgets >= 1, "SessionWidgets is drawn"
    charts = [o for o in _outputs(nb) if PLOTLY in o.get("data", {})]
    assert drawn_charts == len(charts), "every plotly output is drawn with its traces"
    size = saved_path.stat().st_size
    assert size < SAVED_NOTEBOOK_LIMIT, f"the notebook saved from JupyterLab is {size / 2**20:.1f} MiB"
    CHECKS[path.name](nb)
