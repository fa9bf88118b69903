"""workbench.runtime.stats: the session's statistics print as a rounded table and render as HTML in a
notebook, while code still indexes the plain dict runner_core returned."""

from __future__ import annotations

import re

from workbench import Session
from workbench.runtime.stats import Stats, format_value

MEMORY = {"device": "cpu", "weights_bytes": 3478016, "kv_pool_bytes": 16777216, "kv_bytes_per_token": 2048,
          "kv_utilization": 0.8333333333333334, "internal_fragmentation": 0.041666666666666664,
          "static_max_concurrency": 4, "activation_peak_bytes": None}
COMPILE = {"enabled": True, "backend": "inductor", "cache_load_seconds": 0.0007241380008053966,
           "compile_seconds": {1: 99.49955217499883, 16: 0.6616378300022916},
           "decode_programs": {"kind": "AOTInductor", "sizes": [1], "build_seconds": {1: 64.21561465000195},
                               "memory_bytes": 98633792}}
LONG_FLOAT = re.compile(r"\d\.\d{5,}")


def test_stats_are_the_same_dict_printed_as_a_rounded_table():
    stats = Stats(MEMORY, "memory of tiny-llama")
    assert stats == MEMORY and isinstance(stats, dict) and stats["kv_utilization"] == MEMORY["kv_utilization"]
    text = str(stats)
    assert text.splitlines()[0] == "memory of tiny-llama"
    assert not LONG_FLOAT.search(text), text
    lines = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()[1:]}
    assert lines["weights_bytes"] == "3.3 MiB" and lines["kv_pool_bytes"] == "16.0 MiB"
    assert lines["kv_bytes_per_token"] == "2.0 KiB"
    assert lines["kv_utilization"] == "83.3 %" and lines["internal_fragmentation"] == "4.2 %"
    assert lines["static_max_concurrency"] == "4" and lines["activation_peak_bytes"] == "–"
    html = stats._repr_html_()
    assert html.startswith("<table") and "<th" in html and "16.0 MiB" in html and "83.3 %" in html


def test_nested_figures_are_rounded_and_indented():
    text = str(Stats(COMPILE))
    assert not LONG_FLOAT.search(text), text
    assert "1: 99.50 s, 16: 0.66 s" in text and "0.72 ms" in text
    assert re.search(r"^  decode_programs$", text, re.M)  # a heading, its figures one level deeper
    assert re.search(r"^    build_seconds +1: 64.22 s$", text, re.M)
    assert re.search(r"^    memory_bytes +94.1 MiB$", text, re.M)
    assert format_value("tokens_per_s", 123.456789) == "123.5"  # a rate is not seconds


def test_session_stats_render_as_tables(tiny_llama_path):
    s = Session()
    try:
        s.load_model("tiny-llama", dtype="float32", device="cpu", kv_cache_memory=4 << 20, max_model_len=256)
        stats = s.memory_stats()
        runner_stats = s.models["tiny-llama"].runner.memory_stats()
        assert isinstance(stats, Stats) and set(stats) == set(runner_stats)
        assert type(runner_stats) is dict, "runner_core returns plain dicts"
        assert stats["kv_pool_bytes"] == 4 << 20 and "4.0 MiB" in str(stats) and "<table" in stats._repr_html_()
        assert isinstance(s.compile_stats(), Stats) and not LONG_FLOAT.search(str(s.compile_stats()))
        freed = s.unload()
        assert isinstance(freed, Stats) and freed["name"] == "tiny-llama" and "MiB" in str(freed)
    finally:
        s.close()
