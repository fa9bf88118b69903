"""The Live tab's step view in a real browser, served in this process so the session's own records can be read
back: `make run`'s model (tiny-speaker) with the dashboard's load settings, its default workload run by a click,
and the step charts holding one point per engine step of that run (per k steps past STEP_POINTS); pause, one step
and resume by buttons. The screenshot is the README's."""

from __future__ import annotations

import pytest

from tests.test_workbench_browser import OUT, SLOW, open_page
from workbench import Session
from workbench.views.controller import load_config
from workbench.views.forms import DEFAULT_LOAD, DEFAULT_MODEL
from workbench.views.step_view import STEP_POINTS
from workbench.views.timeline import last_run, thin


@pytest.fixture(scope="module")
def served():
    from workbench.views.panel_app import serve

    session = Session()
    session.load_model(DEFAULT_MODEL, **load_config(DEFAULT_LOAD["dtype"], "cpu", DEFAULT_LOAD["kv_cache_memory_mib"],
                                                    DEFAULT_LOAD["max_model_len"]))
    server = serve(session, threaded=True)
    yield session, server.url
    server.stop()
    session.close()


@pytest.fixture(scope="module")
def page(served):
    yield from open_page(served[1], height=1500)


def _xs(page, chart: str, trace: int = 0) -> list:
    return page.locator(f".wb-chart-{chart} .js-plotly-plot").evaluate(
        f"el => (el.data && el.data[{trace}] && el.data[{trace}].x) ? Array.from(el.data[{trace}].x) : []")


def test_the_default_workload_is_drawn_one_point_per_engine_step(served, page):
    from playwright.sync_api import expect

    session, _ = served
    expect(page.locator(".wb-workload-plan")).to_contain_text("64 requests arriving at random", timeout=SLOW)
    page.get_by_role("button", name="Run workload").click()
    expect(page.locator(".wb-workload-status")).to_contain_text("64/64 requests done", timeout=4 * SLOW)
    assert session.wait_idle(60)
    records = last_run(session.steps()[0])
    run = [r.step for r in records]
    assert len(run) > 64
    # every step chart of the run: a point per engine step the session recorded, in order; a run longer than
    # STEP_POINTS steps: a point per k steps (at the last of them), and the title says so
    points, k = thin(records, STEP_POINTS)
    xs = [p["step"] for p in points]
    assert len(xs) <= STEP_POINTS and xs[-1] == run[-1]
    plot = page.locator(".wb-chart-throughput .js-plotly-plot").element_handle()  # (Panel's panes: shadow DOM)
    page.wait_for_function("([el, n]) => el.data && el.data[0] && el.data[0].x && el.data[0].x.length === n",
                           arg=[plot, len(xs)], timeout=SLOW)
    assert _xs(page, "throughput") == xs  # prefill tokens per step
    assert _xs(page, "throughput", 1) == xs  # decode tokens per step
    assert _xs(page, "blocks") == xs and _xs(page, "step-times") == xs
    if k > 1:
        expect(page.locator(".wb-chart-blocks")).to_contain_text(f"a point per {k} steps")
    expect(page.locator(".wb-chart-batch")).to_contain_text(f"Step {run[-1]}:")
    page.screenshot(path=str(OUT / "step-view.png"), full_page=True)


def test_pause_step_and_resume_from_the_page(served, page):
    from playwright.sync_api import expect

    session, _ = served
    page.get_by_role("button", name="Pause").click()
    assert _wait(lambda: session.paused)
    handle = session.submit("the river", max_tokens=8, temperature=0.0, ignore_eos=True)
    before = len(session.steps()[0])
    page.get_by_role("button", name="Step").click()
    assert _wait(lambda: handle.num_tokens == 1)
    expect(page.locator(".wb-chart-batch")).to_contain_text(f"Step {before + 1}: 1 requests ran", timeout=SLOW)
    page.get_by_role("button", name="Resume").click()
    assert len(handle.result(60).token_ids) == 8 and not session.paused


def _wait(predicate, timeout: float = 30.0) -> bool:
    from tests.sessions import wait_until

    return wait_until(predicate, timeout)
