"""Quantize to fit: the fit advisor names the storage format (bfloat16, int8, int4) that makes a model fit a
given memory, the least loss of quality first, with its stored size and measured cost; the ConfigError of a
configuration that cannot fit lists it; suggest_parallel_config weighs formats against devices."""

from __future__ import annotations

import pytest

from runner_core import ConfigError, RunnerConfig, suggest_parallel_config
from runner_core.memory.estimate import estimate_memory
from runner_core.memory.fit import (
    QUALITY_COST,
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


def test_the_ladder_goes_from_the_least_loss_of_quality():
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
    # every format has its measured cost, and the order is the measured one: perplexity rises along the int4
    # groups, agreement falls along the whole ladder
    assert sorted(QUALITY_COST) == sorted(label for label, _ in STORAGE_LADDER)
    ppl = [QUALITY_COST[f"int4 g{g}"]["perplexity_change"] for g in (32, 64, 128)]
    agree = [QUALITY_COST[label]["greedy_agreement"] for label, _ in STORAGE_LADDER]
    assert ppl == sorted(ppl) and agree == sorted(agree, reverse=True)


def test_the_config_error_lists_the_format_with_its_cost():
    config = RunnerConfig(model="small-llama", dtype="bfloat16", **KW)
    est = estimate_memory("small-llama", dtype="bfloat16", **KW)
    int8 = estimate_memory("small-llama", dtype="bfloat16", quantization="int8", **KW)
    with pytest.raises(ConfigError) as info:
        check_config_fits(config, available_bytes=(required_bytes(int8) + required_bytes(est)) // 2)
    msg = str(info.value)
    assert f"weights {est.weights_bytes / MiB:.1f} MiB in bfloat16" in msg
    cost = QUALITY_COST["int8"]
    assert (f"quantization='int8' (weights {int8.weights_bytes / MiB:.1f} MiB stored" in msg
            and f"measured: perplexity {cost['perplexity_change']:+.2%}, "
                f"greedy agreement {cost['greedy_agreement']:.0%}" in msg)
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
