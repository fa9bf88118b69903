"""Quantize to fit: the fit advisor names the storage format (bfloat16, int8, int4) that makes a model fit a
given memory, the least compression first, with its stored size and what it cost tiny-speaker in the benchmark
run docs/benchmarks.md reports; the ConfigError of a configuration that cannot fit lists it;
suggest_parallel_config weighs formats against devices."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import quant
from runner_core import ConfigError, RunnerConfig, suggest_parallel_config
from runner_core.memory.estimate import estimate_memory
from runner_core.memory.fit import (
    QUALITY_COST,
    QUALITY_RECORD,
    STORAGE_LADDER,
    check_config_fits,
    fit_suggestions,
    required_bytes,
    storage_ladder,
    storage_options,
)

KW = {"max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 256}
MiB = 2**20


def _need(**settings) -> int:
    return required_bytes(estimate_memory("small-llama", **KW, **settings))


def test_the_format_that_fits_is_named_with_its_stored_bytes():
    """bfloat16 small-llama in a budget between its int8 need and its own: int8 is named (int4 would fit
    too, but loses more), with the int8 weights' size; the int4 weights are smaller still."""
    est = estimate_memory("small-llama", dtype="bfloat16", **KW)
    int8 = estimate_memory("small-llama", dtype="bfloat16", quantization="int8", **KW)
    int4 = estimate_memory("small-llama", dtype="bfloat16", quantization="int4", quantization_group_size=128, **KW)
    assert int4.weights_bytes < int8.weights_bytes < est.weights_bytes == est.dense_weights_bytes
    assert int8.dense_weights_bytes == est.weights_bytes and int8.quantization == "int8"
    budget = (required_bytes(int8) + required_bytes(est)) // 2
    tips = fit_suggestions(est, budget)
    assert tips[0].startswith(f"quantization='int8' (weights {int8.weights_bytes / MiB:.1f} MiB stored, "
                              f"needs {required_bytes(int8) / MiB:.1f} MiB: fits")
    # below int8's need and int4 g64's, int4 in groups of 128 (the fewest scales) is named
    only_int4 = (required_bytes(int4) + _need(dtype="bfloat16", quantization="int4", quantization_group_size=64)) // 2
    assert fit_suggestions(est, only_int4)[0].startswith("quantization='int4', quantization_group_size=128")


def test_a_model_that_fits_gets_no_suggestion():
    est = estimate_memory("small-llama", dtype="float32", **KW)
    assert fit_suggestions(est, required_bytes(est)) == []
    assert check_config_fits(RunnerConfig(model="small-llama", dtype="float32", **KW),
                             available_bytes=required_bytes(est)).quantization is None


def test_the_ladder_goes_from_the_least_compression():
    """float32: bfloat16 first (it fits before int8 here: it halves the embedding and the KV cache too), then
    int8, int4 g32, g64, g128; an int8 model is offered only int4; an int4 g64 one only the larger group."""
    f32 = estimate_memory("small-llama", dtype="float32", **KW)
    assert [label for label, _ in storage_ladder(f32)] == ["bfloat16", "int8", "int4 g32", "int4 g64", "int4 g128"]
    options = storage_options(f32, _need(dtype="bfloat16"))
    assert [o.fits for o in options][:1] == [True]
    assert fit_suggestions(f32, _need(dtype="bfloat16"))[0].startswith("dtype='bfloat16'")
    int8 = estimate_memory("small-llama", dtype="float32", quantization="int8", **KW)
    assert [label for label, _ in storage_ladder(int8)] == ["bfloat16", "int4 g32", "int4 g64", "int4 g128"]
    g64 = estimate_memory("small-llama", dtype="bfloat16", quantization="int4", **KW)
    assert [label for label, _ in storage_ladder(g64)] == ["int4 g128"]
    sizes = [o.weights_bytes for o in storage_options(f32, 0)[1:]]  # int8, int4 g32, g64, g128
    assert sizes == sorted(sizes, reverse=True)


DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
QUOTED = re.compile(
    r"Perplexity \((?P<paragraphs>\d+) held-out paragraphs, (?P<tokens>[\d,]+) tokens\): float32 (?P<float32>[\d.]+), "
    r"bf16 (?P<bfloat16>\S+)%, int8 (?P<int8>\S+)%, int4 g32 / g64 / g128 (?P<g32>\S+) / (?P<g64>\S+) / (?P<g128>\S+)%"
    r".*?Command: `(?P<command>[^`]+)`")


def quoted_perplexity(markdown: str) -> dict:
    """The weight formats' perplexity run as the "Weight formats" section of docs/benchmarks.md reports it."""
    section = markdown.split("\n## Weight formats", 1)[1].split("\n## ", 1)[0]
    m = QUOTED.search(" ".join(section.split()))
    assert m, "docs/benchmarks.md's Weight formats section no longer quotes the perplexity run the fit advisor cites"
    num = {k: float(v.replace("−", "-").replace(",", "")) for k, v in m.groupdict().items() if k != "command"}
    return {"date": section.split("**", 2)[1], "command": m["command"], **num}


def test_the_advisors_quality_figures_are_the_benchmark_run_the_docs_report():
    """QUALITY_COST is the tiny-speaker perplexity run of docs/benchmarks.md (Weight formats), figure for
    figure, and QUALITY_RECORD names that run: its paragraphs (quant.py's default for its command), tokens,
    float32 perplexity, command and date; the advisor's words name the model and the run."""
    run = quoted_perplexity(DOCS.read_text(encoding="utf-8"))
    assert sorted(QUALITY_COST) == sorted(label for label, _ in STORAGE_LADDER)
    assert QUALITY_COST == {label: pytest.approx(run[label.removeprefix("int4 ")] / 100, abs=1e-9)
                            for label in QUALITY_COST}
    record = {k: QUALITY_RECORD[k] for k in ("paragraphs", "tokens", "command")}
    assert record == {"paragraphs": run["paragraphs"], "tokens": run["tokens"], "command": run["command"]}
    assert QUALITY_RECORD["float32_perplexity"] == run["float32"] and QUALITY_RECORD["date"] in run["date"]
    assert quant.parse_args(run["command"].split()[2:]).ppl_paragraphs == run["paragraphs"]
    words = storage_options(estimate_memory("small-llama", dtype="float32", **KW), 0)[3].quality
    assert words == (f"quality measured on tiny-speaker, not on this model: perplexity +0.59% over "
                     f"{run['paragraphs']:.0f} held-out paragraphs, benchmarks/quant.py, {QUALITY_RECORD['date']}")


def test_the_config_error_lists_the_format_with_its_cost():
    config = RunnerConfig(model="small-llama", dtype="bfloat16", **KW)
    est = estimate_memory("small-llama", dtype="bfloat16", **KW)
    int8 = estimate_memory("small-llama", dtype="bfloat16", quantization="int8", **KW)
    with pytest.raises(ConfigError) as info:
        check_config_fits(config, available_bytes=(required_bytes(int8) + required_bytes(est)) // 2)
    msg = str(info.value)
    assert f"weights {est.weights_bytes / MiB:.1f} MiB in bfloat16" in msg
    assert (f"quantization='int8' (weights {int8.weights_bytes / MiB:.1f} MiB stored" in msg
            and f"quality measured on tiny-speaker, not on this model: perplexity {QUALITY_COST['int8']:+.2%}" in msg)
    # the configured format is what is estimated and named
    with pytest.raises(ConfigError, match=r"weights [\d.]+ MiB in int8 \(bfloat16 compute\)"):
        check_config_fits(RunnerConfig(model="small-llama", dtype="bfloat16", quantization="int8", **KW),
                          available_bytes=16 * MiB)


def test_the_plan_takes_a_format_before_a_device():
    """suggest_parallel_config(storage_formats=True): where one bfloat16 device is too small but two are
    enough, one device with int8 wins; where one device fits as configured, no format is taken."""
    kw = {"dtype": "bfloat16", "device": "cuda", **KW}

    def need_of(tp=1, **settings):
        est = estimate_memory("small-llama", tensor_parallel_size=tp, **kw, **settings)
        return est.fixed_bytes + est.min_kv_pool_bytes

    one, two, int8 = need_of(), need_of(tp=2), need_of(quantization="int8")
    assert int8 < one and two < one
    memory = max(two, int8) + 1
    assert memory < one
    plain = suggest_parallel_config("small-llama", 2, device_memory=memory, gpu_memory_utilization=1.0, **kw)
    assert plain.as_config() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}
    plan = suggest_parallel_config("small-llama", 2, device_memory=memory, gpu_memory_utilization=1.0,
                                   storage_formats=True, **kw)
    assert plan.as_config() == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "quantization": "int8"}
    assert plan.per_device_bytes == int8 and "with int8 weights" in plan.reason
    assert "tp=1 pp=1 int8:" in str(plan) and "tp=2 pp=1:" in str(plan)
    roomy = suggest_parallel_config("small-llama", 2, device_memory=one, gpu_memory_utilization=1.0,
                                    storage_formats=True, **kw)
    assert roomy.as_config() == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
