"""The what-if cost model and hardware table (runner_core/simulator/cost_model.py, fit.py, hardware.py): shapes
from config objects only, no model loaded."""

import dataclasses
import math

import pytest
from transformers import LlamaConfig, MixtralConfig

from runner_core.errors import ConfigError
from runner_core.memory.shapes import ModelShape
from runner_core.simulator.cost_model import CostModel, fit_coefficients
from runner_core.simulator.hardware import HARDWARE, Coefficients, get_hardware

H100 = get_hardware("h100-sxm")


def llama_70b() -> ModelShape:
    return ModelShape.from_hf_config(LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192))


def llama_8b() -> ModelShape:
    return ModelShape.from_hf_config(LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192))


def model(shape=None, hardware=H100, band="typical", **kw) -> CostModel:
    hardware = get_hardware(hardware)
    return CostModel(shape or llama_70b(), hardware, hardware.coefficients(band), dtype="bfloat16", **kw)


def decode(n: int, kv: int) -> tuple[list[int], list[int], int]:
    return [kv] * n, [1] * n, n


def test_decode_step_time_grows_with_kv_length_and_batch():
    m = model()
    assert m.step_time(*decode(32, 2000)) > m.step_time(*decode(32, 200))
    assert m.step_time(*decode(64, 1000)) > m.step_time(*decode(8, 1000))
    # a batch shares the weight reads: 8x the rows costs far less than 8x the time
    assert m.step_time(*decode(64, 1000)) < 2 * m.step_time(*decode(8, 1000))


def test_70b_prefill_is_compute_bound_and_decode_memory_bound_on_h100():
    m = model()
    assert m.breakdown([0], [2048], 1)["bound"] == "compute"
    assert m.breakdown(*decode(32, 1000))["bound"] == "memory"
    # memory-bound decode: the linear layers take about the weights over the bandwidth actually reached
    weights = m.breakdown(*decode(1, 100))["weight_bytes"]
    assert weights == pytest.approx(70.5e9 * 2 - 128256 * 8192 * 2, rel=0.01)  # all but the embedding
    c = H100.coefficients()
    assert m.breakdown(*decode(1, 100))["linear_s"] == pytest.approx(
        weights / (H100.mem_bandwidth * c.memory_efficiency), rel=0.01)


def test_breakdown_adds_up_to_step_time_and_features_reproduce_it():
    m = model(tensor_parallel_size=4, pipeline_parallel_size=2)
    c = m.coefficients
    for step in (decode(48, 700), ([300, 0], [1, 1500], 2), ([0] * 4, [256] * 4, 4)):
        parts = m.breakdown(*step)
        assert parts["total_s"] == pytest.approx(m.step_time(*step), rel=1e-12)
        assert parts["total_s"] == pytest.approx(
            parts["linear_s"] + parts["attention_s"] + parts["comm_s"] + parts["fixed_s"], rel=1e-12)
        f = m.features(*step)
        assert (f["linear_compute_s"] / c.compute_efficiency + f["linear_memory_s"] / c.memory_efficiency
                + f["attention_s"] / c.attention_efficiency + f["decode_attention_s"] / c.decode_attention_efficiency
                + f["one"] * c.step_s + f["layers"] * c.layer_s
                + f["seqs"] * c.seq_s + f["tokens"] * c.token_s + f["comm_s"]) == pytest.approx(
            m.step_time(*step), rel=1e-12)


def test_attention_counts_query_key_pairs_and_kv_reads():
    shape = llama_70b()
    m = model(shape)
    c, bw, peak = m.coefficients, H100.mem_bandwidth, H100.peak_flops["bfloat16"]
    s, n = 1000, 512
    pairs = n * s + n * (n + 1) / 2
    flops = 4 * pairs * 64 * 128 * 80
    kv_bytes = (s + n) * 80 * 2 * 8 * 128 * 2
    prefill = max(flops / peak, kv_bytes / bw) / c.attention_efficiency
    assert m.breakdown([s], [n], 1)["attention_s"] == pytest.approx(prefill)
    # a decode row reads its whole KV cache (the decode kernel: a share of the bandwidth); a mixed step pays both
    decode = (s + 1) * 80 * 2 * 8 * 128 * 2 / bw / c.decode_attention_efficiency
    assert m.breakdown([s], [1], 1)["attention_s"] == pytest.approx(decode)
    assert m.breakdown([s, s], [1, n], 2)["attention_s"] == pytest.approx(prefill + decode)
    f = m.features([s, s], [1, n], 2)
    assert f["attention_s"] == pytest.approx(prefill * c.attention_efficiency)
    assert f["decode_attention_s"] == pytest.approx(decode * c.decode_attention_efficiency)


def test_tp8_cuts_linear_time_8x_and_adds_the_docs_all_reduce_time():
    one, tp8 = model(), model(tensor_parallel_size=8)
    prefill = ([0], [4096], 1)
    assert one.breakdown(*prefill)["linear_s"] / tp8.breakdown(*prefill)["linear_s"] == pytest.approx(8, rel=0.02)
    assert one.breakdown(*prefill)["comm_s"] == 0
    # docs/parallel.md: (2 layers + 1) all-reduces of T x hidden x bytes, ring 2(t-1)/t, + the logits all-gather
    tokens, rows, lat, link = 64, 64, H100.link_latency_s, H100.link_bandwidth
    all_reduce = lat + 2 * 7 / 8 * tokens * 8192 * 2 / link
    gather = lat + 7 / 8 * rows * 128256 * 2 / link
    assert tp8.breakdown(*decode(64, 1000))["comm_s"] == pytest.approx((2 * 80 + 1) * all_reduce + gather)
    # the docs' figure: a TP=8 decode step of 64 sequences on NVLink costs ~2 ms of all-reduce (70B)
    assert 1e-3 < tp8.breakdown(*decode(64, 1000))["comm_s"] < 3e-3


def test_pp_adds_sends_and_the_step_is_the_sum_of_its_stages():
    one, pp4 = model(), model(pipeline_parallel_size=4)
    step = decode(32, 1000)
    a, b = one.breakdown(*step), pp4.breakdown(*step)
    lat, link = H100.link_latency_s, H100.link_bandwidth
    sends = 3 * (lat + 32 * 8192 * 2 / link) + lat + 32 * 128256 * 4 / link  # hidden states + float32 logits
    assert b["comm_s"] == pytest.approx(sends)
    assert b["linear_s"] == pytest.approx(a["linear_s"]) and b["attention_s"] == pytest.approx(a["attention_s"])
    assert b["total_s"] == pytest.approx(a["total_s"] + sends)
    busy = b["total_s"] - b["fixed_s"]
    assert b["bubble_s"] == pytest.approx(busy * 3 / 4)  # each device idles while the other 3 stages run
    uneven = model(pipeline_parallel_size=2, pipeline_stage_layers=[50, 30])
    assert uneven.step_time(*step) == pytest.approx(model(pipeline_parallel_size=2).step_time(*step))
    with pytest.raises(ConfigError, match="adds up to"):
        model(pipeline_parallel_size=2, pipeline_stage_layers=[50, 20])


def test_quantized_formats_read_fewer_weight_bytes():
    step = decode(16, 500)
    read = {fmt: model(weight_format=fmt).breakdown(*step)["weight_bytes"] for fmt in (None, "fp8", "int8", "int4")}
    assert read["int4"] < read["int8"] <= read["fp8"] < read[None]
    assert read["int8"] / read[None] == pytest.approx(0.5, abs=0.02)  # the bf16 LM head stays
    assert model(weight_format="int4").step_time(*step) < model(weight_format="int8").step_time(*step) \
        < model().step_time(*step)
    # fp8 multiplies at the fp8 peak (W8A8): a compute-bound prefill is faster; int8 is weight-only
    prefill = ([0], [4096], 1)
    assert model(weight_format="fp8").breakdown(*prefill)["linear_s"] < 0.6 * model().breakdown(*prefill)["linear_s"]
    assert model(weight_format="int8").breakdown(*prefill)["linear_s"] == pytest.approx(
        model().breakdown(*prefill)["linear_s"], rel=0.02)
    # the A100 has no fp8 peak: fp8 runs weight-only there (as vLLM's Marlin kernels do)
    assert model(hardware="a100-sxm-80g", weight_format="fp8").compute_format == "bfloat16"
    with pytest.raises(ValueError, match="storage format"):
        model(weight_format="nf4")


def test_moe_reads_fewer_weight_bytes_per_step_than_its_dense_total():
    shape = ModelShape.from_hf_config(MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))
    m = model(shape)
    total = m.total_weight_bytes()
    assert total == pytest.approx(46.7e9 * 2 - 32000 * 4096 * 2, rel=0.01)  # Mixtral-8x7B, all but the embedding
    one = m.breakdown(*decode(1, 100))["weight_bytes"]
    assert one < 0.4 * total  # 2 of 8 experts and the attention
    many = m.breakdown(*decode(256, 100))["weight_bytes"]
    assert one < many <= total and many == pytest.approx(total, rel=0.01)  # 256 tokens hit every expert
    assert m.step_time(*decode(1, 100)) < model(llama_70b()).step_time(*decode(1, 100))


def test_fit_recovers_known_coefficients():
    truth = Coefficients(compute_efficiency=0.55, memory_efficiency=0.8, attention_efficiency=0.4,
                         decode_attention_efficiency=0.6, step_s=2e-3,
                         layer_s=20e-6, seq_s=15e-6, token_s=1e-6)
    rows = []
    for shape in (llama_70b(), llama_8b()):
        m = CostModel(shape, H100, truth, dtype="bfloat16")
        steps = [decode(n, kv) for n in (1, 8, 64, 200) for kv in (100, 3000)]
        steps += [([0], [t], 1) for t in (1024, 4096)] + [([500] * 30 + [0], [1] * 30 + [700], 31)]
        rows += [(m.features(*s), m.step_time(*s)) for s in steps]
    fitted = fit_coefficients(rows)
    for name, value in dataclasses.asdict(truth).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.01), name


def test_fit_of_one_model_folds_the_layer_cost_into_the_step_cost_and_refuses_too_few_shapes():
    truth = Coefficients(0.6, 0.8, 0.5, 0.7, step_s=1e-3, layer_s=10e-6, seq_s=20e-6, token_s=0.0)
    m = CostModel(llama_8b(), H100, truth, dtype="bfloat16")
    steps = [decode(n, kv) for n in (1, 16, 128) for kv in (64, 2048)] + [([0], [t], 1) for t in (1024, 3072)]
    steps += [([0] * 4, [768] * 4, 4), ([200] * 20 + [0], [1] * 20 + [600], 21)]
    rows = [(m.features(*s), m.step_time(*s)) for s in steps]
    fitted = fit_coefficients(rows)
    assert fitted.layer_s == 0 and fitted.step_s == pytest.approx(1e-3 + 32 * 10e-6, rel=0.01)
    assert fitted.memory_efficiency == pytest.approx(0.8, rel=0.01)
    with pytest.raises(ValueError, match="at least 7 distinct step shapes"):
        fit_coefficients(rows[:3])
    decodes_only = [(m.features(*s), m.step_time(*s)) for s in steps[:6] + [decode(40, 300)]]
    with pytest.raises(ValueError, match="compute_efficiency"):
        fit_coefficients(decodes_only)  # no compute-bound step


def test_band_orders_step_times_pessimistic_to_optimistic():
    for name, spec in HARDWARE.items():
        for step in (decode(32, 1000), ([0], [2048], 1)):
            low, typical, high = (model(llama_8b(), spec, band).step_time(*step) for band in ("low", "typical", "high"))
            assert low > typical > high, name
            assert low / high < 3, name  # wide enough to be honest, narrow enough to be useful


def test_hardware_table_has_sources_and_plausible_figures():
    for name, spec in HARDWARE.items():
        assert get_hardware(name) is spec and get_hardware(spec) is spec
        for fieldname in ("peak_flops", "mem_bandwidth", "memory_bytes", "link_bandwidth", "devices_per_node"):
            assert spec.sources.get(fieldname), (name, fieldname)
        assert spec.peak_flops["bfloat16"] > spec.peak_flops["float32"] and spec.reserved_bytes < spec.memory_bytes
        assert spec.as_dict()["band"]["typical"] == spec.band["typical"].as_dict()
    assert HARDWARE["h200"].memory_bytes > 140 * 2**30 and HARDWARE["h200"].mem_bandwidth == 4.8e12


def test_unknown_hardware_and_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="h100-sxm.*mi300x"):
        get_hardware("h800")
    with pytest.raises(ValueError, match="band"):
        H100.coefficients("best")
    with pytest.raises(ConfigError, match="does not divide num_attention_heads"):
        model(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="one of each"):
        model().step_time([1, 2], [1], 1)
    cpu = dataclasses.replace(H100, name="cpu:test", kind="cpu", peak_flops={"float32": 1e11}, band={},
                              efficiency=H100.coefficients())
    with pytest.raises(ValueError, match="no bfloat16 peak"):
        model(hardware=cpu)
    assert math.isfinite(CostModel(llama_8b(), cpu, cpu.coefficients(), dtype="float32").step_time(*decode(4, 10)))


def test_an_fp8_kv_cache_halves_a_decode_steps_kv_read():
    bf16, fp8 = model(), model(kv_cache_dtype="fp8")
    step = decode(64, 4000)
    assert fp8.breakdown(*step)["attention_s"] == pytest.approx(bf16.breakdown(*step)["attention_s"] / 2)
    assert fp8.breakdown(*step)["linear_s"] == bf16.breakdown(*step)["linear_s"]
    assert fp8.step_time(*step) < bf16.step_time(*step)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not a KV cache format"):
        model(kv_cache_dtype="int8")
