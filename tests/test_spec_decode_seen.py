"""Speculative decoding seen from the workbench: the API's usage (OpenAI's completion_tokens_details and the
`spec_decoding` extension, read by the official client), the Prometheus spec_decode_* counters, the session's stats
table, the step view's chart from a session run with n-gram speculation on, and both dashboards' switch (through
reconfigure, no reload). tiny-speaker (the trained preset) repeats itself, so its drafts get accepted."""

from __future__ import annotations

import httpx
import pytest

from tests.sessions import TINY
from workbench import Session
from workbench.views import spec_charts
from workbench.views.spec_view import speculative_config
from workbench.views.timeline import last_run

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PROMPT = "def get(self, key):\n    return self.get(key)\ndef set(self, key):\n    return self."


@pytest.fixture(scope="module")
def spec_session():
    s = Session()
    s.load_model("tiny-speaker", **TINY, speculative_config=SPEC)
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(spec_session):
    srv = spec_session.serve_api()
    yield srv
    srv.stop()


def test_usage_reports_the_drafts_accepted_and_the_official_client_reads_it(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny-speaker", prompt=PROMPT, max_tokens=32, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    details = out.usage.completion_tokens_details
    spec = out.usage.model_extra["spec_decoding"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert details.accepted_prediction_tokens == spec["num_accepted_tokens"]
    assert details.rejected_prediction_tokens == spec["num_draft_tokens"] - spec["num_accepted_tokens"]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert out.usage.completion_tokens == 32

    # the streamed usage chunk carries the same figures
    body = {"model": "tiny-speaker", "prompt": PROMPT, "max_tokens": 32, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json

    last = json.loads(lines[-1][len("data: "):])
    assert last["usage"]["spec_decoding"]["num_accepted_tokens"] == spec["num_accepted_tokens"]


def test_prometheus_counts_drafts_and_acceptance_by_position(server):
    client = httpx.Client(base_url=server.url, timeout=60)
    client.post("/v1/completions", json={"model": "tiny-speaker", "prompt": PROMPT, "max_tokens": 24,
                                         "temperature": 0.0, "ignore_eos": True}).raise_for_status()
    text = client.get("/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("runner_workbench:spec_decode_")}
    label = 'model_name="tiny-speaker"'
    drafts = values[f"runner_workbench:spec_decode_num_drafts_total{{{label}}}"]
    draft_tokens = values[f"runner_workbench:spec_decode_num_draft_tokens_total{{{label}}}"]
    accepted = values[f"runner_workbench:spec_decode_num_accepted_tokens_total{{{label}}}"]
    first = values[f'runner_workbench:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}}']
    assert 0 < accepted <= draft_tokens and drafts > 0 and 0 < first <= drafts
    per_pos = [v for k, v in values.items() if "per_pos_total" in k]
    assert sum(per_pos) == accepted


def test_session_stats_and_the_step_chart_show_speculation(spec_session):
    s = spec_session
    s.generate(PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True, timeout=60)
    stats = s.memory_stats()
    spec = stats["spec_decoding"]
    assert spec["num_speculative_tokens"] == 4 and spec["num_accepted_tokens"] > 0
    assert "acceptance_rate" in str(stats) and "%" in str(stats).split("acceptance_rate", 1)[1].splitlines()[0]

    run = last_run(s.steps()[0])
    fig = spec_charts.spec_decoding(run)
    proposed, accepted, by_position = fig.data
    total = spec_charts.run_totals(run)
    assert total["num_accepted_tokens"] > 0
    assert sum(accepted.y) == total["num_accepted_tokens"] and sum(proposed.y) == total["num_draft_tokens"]
    assert len(by_position.y) == 4 and by_position.y[0] >= by_position.y[-1]  # a prefix is accepted
    assert "tokens per verified step" in fig.layout.title.text
    empty = spec_charts.spec_decoding([])
    assert not empty.data and "turn n-gram speculation on" in empty.layout.annotations[-1].text


def test_both_dashboards_switch_speculation_without_a_reload(spec_session):
    from workbench.views.panel_app import SessionDashboard
    from workbench.views.widgets import SessionWidgets

    s = spec_session
    assert speculative_config(False, 3) is None
    runner = s.models["tiny-speaker"].runner
    ui = SessionWidgets(s, auto_refresh=False)
    try:
        ui.spec_on.value, ui.spec_k.value = True, 2
        ui.spec_button.click()
        ui.wait(60)
        assert s.models["tiny-speaker"].runner is runner  # the same weights: reconfigured, not reloaded
        assert s.models["tiny-speaker"].config.speculative_config["num_speculative_tokens"] == 2
        ui.prompt.value, ui.max_tokens.value, ui.temperature.value, ui.ignore_eos.value = PROMPT, 16, 0.0, True
        ui.generate_button.click()
        ui.wait(60)
        assert ui.handle.spec_decoding["num_drafts"] > 0
        assert "finished" in ui.stats.value and "tokens a verified step" in ui.stats.value  # the answer's line
        # acceptance by position: the chart's positions are its run's (an earlier test's k=4 steps may belong to
        # that run when they came less than a run's gap before); the steps since the switch draft k=2 at most
        run = last_run(s.steps()[0])
        drafted = [st.spec_decoding.num_draft_tokens_per_pos for st in run if st.spec_decoding is not None]
        assert 1 <= len(drafted[-1]) <= 2
        positions = spec_charts.run_totals(run)["num_draft_tokens_per_pos"]
        assert len(ui.figures["spec_decoding"].data[2].y) == len(positions)
    finally:
        ui.close()
    panel = SessionDashboard(s)
    panel.spec_on.value = False
    panel.spec_button.clicks += 1
    s.wait_idle(60)
    for _, fut in panel.jobs:
        fut.result(60)
    assert s.models["tiny-speaker"].config.speculative_config is None
    assert "spec_decoding" not in s.memory_stats()
    s.reconfigure(speculative_config=SPEC)  # as the module's other tests expect
