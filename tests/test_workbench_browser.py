"""The Panel dashboard in a real browser: `python -m workbench serve` on a free port, driven by
Debian's Chromium through Playwright. Loads tiny-llama by clicking, streams a generation,
watches a chart gain points, and sees bad input reported in the page."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dashboard_server import served_dashboard

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "test-output" / "workbench"
CHROMIUM = "/usr/bin/chromium"
# Headless, and no calls home: on a closed network Chromium's background connections fail loudly.
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions"]
SLOW = 90_000  # ms: loading and generating on a busy 2-core CPU


def _require_browser():
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    import playwright.sync_api  # a test dependency: `make test` installs it

    return playwright.sync_api


@pytest.fixture(scope="module")
def server_url(tiny_llama_path):
    """The dashboard served by the CLI, as a user starts it; the URL it prints."""
    with served_dashboard() as url:
        assert url.startswith("http://127.0.0.1:"), "binds loopback by default"
        yield url


def open_page(url: str, height: int = 1350):
    """Chromium headless on `url`, for a module fixture to `yield from` (closed after)."""
    sync_api = _require_browser()
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": height})
        page.goto(url, timeout=SLOW)
        yield page
        browser.close()


@pytest.fixture(scope="module")
def page(server_url):
    yield from open_page(server_url)


def _fill(page, *fields: tuple[str, str]) -> None:
    """Type each (selector, value) into its field and press Enter (Panel reads a field's value then)."""
    for field, value in fields:
        page.locator(field).fill(value)
        page.locator(field).press("Enter")


def _points(page, chart: str) -> int:
    return page.locator(f".wb-chart-{chart} .js-plotly-plot").evaluate(
        "el => (el.data && el.data[0] && el.data[0].x) ? el.data[0].x.length : 0")


def test_dashboard_end_to_end(page):
    from playwright.sync_api import expect

    error, info = page.locator(".wb-error"), page.locator(".wb-info")
    status, answer, stats = page.locator(".wb-status"), page.locator(".wb-answer pre"), page.locator(".wb-answer-stats")
    generate = page.get_by_role("button", name="Generate")
    expect(page.get_by_role("button", name="Load model")).to_be_visible(timeout=SLOW)
    expect(status).to_contain_text("no model loaded")

    # bad input 1: generating with no model loaded
    generate.click()
    expect(error).to_contain_text("no model is loaded")

    # load tiny-llama by clicking (a random preset: room for a long generation); a second click while it
    # loads is refused
    expect(page.locator(".wb-model select")).to_have_value("tiny-speaker")  # the default: the trained preset
    page.locator(".wb-model select").select_option("tiny-llama")
    page.locator(".wb-max-len input").fill("2048")
    page.locator(".wb-max-len input").press("Enter")
    page.get_by_role("button", name="Load model").click()
    page.get_by_role("button", name="Load model").click()
    expect(error).to_contain_text("still loading")
    expect(info).to_contain_text("Load tiny-llama: done", timeout=SLOW)
    expect(status).to_contain_text("active model: tiny-llama")
    expect(page.locator(".wb-models")).to_contain_text("weights")
    expect(page.locator(".wb-chart-memory .js-plotly-plot")).to_be_visible()

    # bad input 2: zero max tokens
    max_tokens = page.locator(".wb-max-tokens input")
    max_tokens.fill("0")
    max_tokens.press("Enter")
    generate.click()
    expect(error).to_contain_text("max_tokens got 0")
    expect(status).to_contain_text("idle")  # nothing hung

    # a streamed generation, paced at 300 ms a step (2000 tokens: 10 minutes, so it is still running when the
    # clicks below land, however far the page lags behind a busy machine): text shows up while it runs; then
    # cancel it
    page.locator(".wb-pace select").select_option("300 ms a step")
    max_tokens.fill("2000")
    max_tokens.press("Enter")
    page.locator(".wb-ignore-eos input").check()
    temperature = page.locator(".wb-temperature input")
    temperature.fill("0")
    temperature.press("Enter")
    generate.click()
    expect(stats).to_contain_text("tokens/s", timeout=SLOW)
    expect(stats).not_to_contain_text("finished")
    expect(answer).not_to_have_text("")
    expect(error).to_be_hidden()
    # bad input 3: switching compile mode during a generation is refused, with the reason
    page.get_by_role("button", name="Apply compile mode").click()
    # (on a busy machine the click waits behind the live charts' updates for more than 5 s)
    expect(error).to_contain_text("while 1 generation is running", timeout=SLOW)
    page.get_by_role("button", name="Cancel").click()
    expect(stats).to_contain_text("finished: abort", timeout=SLOW)
    page.locator(".wb-pace select").select_option("full speed")

    # a chart gains points; the block map shows requests holding blocks while a workload runs
    expect(page.locator(".wb-chart-block-map")).to_contain_text("0 requests hold 0 of")  # the cancel freed them
    before = _points(page, "throughput")
    page.locator(".wb-workload-n input").fill("24")
    page.locator(".wb-workload-n input").press("Enter")
    page.get_by_role("button", name="Run workload").click()
    plot = page.locator(".wb-chart-throughput .js-plotly-plot").element_handle()
    page.wait_for_function("([el, n]) => el.data && el.data[0] && el.data[0].x.length > n", arg=[plot, before],
                           timeout=SLOW)
    page.screenshot(path=str(OUT / "dashboard-running.png"), full_page=True)
    expect(page.locator(".wb-workload-status")).to_contain_text("24/24 requests done", timeout=SLOW)
    assert _points(page, "throughput") > before

    # bad input 4: a model directory outside the served dashboard's model roots; the loaded model stays usable
    page.locator(".wb-model-path input").fill("/nonexistent/model/dir")
    page.locator(".wb-model-path input").press("Enter")
    page.get_by_role("button", name="Load model").click()
    expect(error).to_contain_text("is outside the folders this dashboard loads models from", timeout=SLOW)
    expect(status).to_contain_text("active model: tiny-llama")
    page.screenshot(path=str(OUT / "dashboard.png"), full_page=True)
    assert (OUT / "dashboard.png").stat().st_size > 10_000


def test_dashboard_loads_a_quantized_model_and_charts_what_it_saved(page):
    """The load form's storage format reaches the load: tiny-speaker stored as int8 is listed so, and the
    weights chart draws two bars, the int8 bytes below the float32 ones."""
    from playwright.sync_api import expect

    _fill(page, (".wb-model-path input", ""), (".wb-max-len input", "0"))  # as the first test left them
    page.locator(".wb-model select").select_option("tiny-speaker")
    page.locator(".wb-storage select").select_option("int8")
    page.get_by_role("button", name="Load model").click()
    expect(page.locator(".wb-info")).to_contain_text("Load tiny-speaker: done", timeout=SLOW)
    expect(page.locator(".wb-models")).to_contain_text("int8")
    chart = page.locator(".wb-chart-weights")
    expect(chart).to_contain_text("Weights stored as int8", timeout=SLOW)
    bars = chart.locator(".js-plotly-plot").evaluate("el => el.data[0].x")
    assert len(bars) == 2 and 0 < bars[0] < bars[1]
    page.screenshot(path=str(OUT / "dashboard-int8.png"), full_page=True)


def test_dashboard_tuning_tab_runs_a_sweep_live(page):
    """The Tuning tab: a tiny sweep of tiny-llama (two concurrency values, one repeat) started by clicking;
    the progress bar moves, the Pareto chart gets the points and the recommendation is shown."""
    import re

    from playwright.sync_api import expect

    # tiny-llama as the first test loads it (only the active model when that test ran before this one)
    page.locator(".wb-model select").select_option("tiny-llama")
    page.locator(".wb-storage select").select_option("none")
    _fill(page, (".wb-model-path input", ""), (".wb-max-len input", "2048"))
    page.get_by_role("button", name="Load model").click()
    expect(page.locator(".wb-info")).to_contain_text(re.compile("Load tiny-llama: done|tiny-llama is already loaded"),
                                                     timeout=SLOW)
    expect(page.locator(".wb-status")).to_contain_text("active model: tiny-llama", timeout=SLOW)

    page.locator(".wb-tabs .bk-tab").filter(has_text="Tuning").click()
    concurrency = page.locator(".wb-tune-concurrency input")
    expect(concurrency).not_to_have_value("")  # proposed from the KV capacity
    _fill(page, (".wb-tune-concurrency input", "1, 2"), (".wb-tune-seqs input", ""), (".wb-tune-limit input", "1000"),
          (".wb-tune-repeats input", "1"), (".wb-tune-requests input", "4"))
    assert _tune_points(page) == 0
    page.get_by_role("button", name="Start sweep").click()
    progress = page.locator(".wb-tune-progress progress").element_handle()
    page.wait_for_function("el => Number(el.getAttribute('value')) > 0", arg=progress, timeout=SLOW)
    expect(page.locator(".wb-tune-recommendation")).to_contain_text("Recommended: concurrency=", timeout=SLOW)
    expect(page.locator(".wb-tune-status")).to_contain_text("done")
    assert _tune_points(page) == 2, "both points on the Pareto chart"
    page.screenshot(path=str(OUT / "dashboard-tuning.png"), full_page=True)


def _tune_points(page) -> int:
    return page.locator(".wb-tune-pareto .js-plotly-plot").evaluate(
        "el => (el.data || []).filter(t => t.mode === 'markers+text').reduce((n, t) => n + t.x.length, 0)")


def test_dashboard_whatif_tab_simulates_and_draws_the_memory_picture(page):
    """The What-if tab: Llama-3-70B on H100s (one device and eight), its memory picture at once (one device
    does not fit, eight do), then a small simulation whose points reach the Pareto chart."""
    from playwright.sync_api import expect

    page.locator(".wb-tabs .bk-tab").filter(has_text="What-if").click()
    page.locator(".wb-whatif-model select").select_option("llama-3-70b")
    page.locator(".wb-whatif-hardware select").select_option("h100-sxm")
    _fill(page, (".wb-whatif-tp input", "1, 8"), (".wb-whatif-requests input", "1"))
    page.get_by_role("button", name="Memory picture").click()
    memory = page.locator(".wb-whatif-memory")
    expect(memory).to_contain_text("does not fit: needs", timeout=SLOW)
    expect(memory).to_contain_text("fits")
    page.get_by_role("button", name="Simulate").click()
    expect(page.locator(".wb-whatif-status")).to_contain_text("done", timeout=SLOW)
    expect(page.locator(".wb-whatif-status")).to_contain_text("skipped")  # the single H100: not enough memory
    pareto = page.locator(".wb-whatif-pareto .js-plotly-plot")
    simulated = pareto.evaluate("el => (el.data || []).filter(t => t.name === 'simulated h100-sxm x8')"
                                ".reduce((n, t) => n + t.x.length, 0)")
    assert simulated >= 1, "the simulated points on the Pareto chart"
    page.screenshot(path=str(OUT / "dashboard-whatif.png"), full_page=True)
