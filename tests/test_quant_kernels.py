"""The quantized GEMM (kernels/quant_tile.h) against F.linear of the dequantized weight on every kernel tier
this CPU runs, int8 and int4 at each group size, float32 and bfloat16 x; the panel layout's Python side
(runner_core/layers/quantization.py): pack / unpack, packed_bytes, dequantize_rows, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from runner_core.kernels import cpu_kernels_available
from runner_core.layers.quantization import (
    QuantFormat,
    dequantize,
    dequantize_rows,
    pack,
    packed_bytes,
    quant_linear,
    quantize,
    quantize_packed,
    rows_per_chunk,
    unpack,
)


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_kernels_available(), "gcc and ninja are project requirements; see the warning logged above"


FORMATS = [QuantFormat.of("int8"), QuantFormat.of("int4", 32), QuantFormat.of("int4", 64), QuantFormat.of("int4", 128)]
IDS = ["int8", "int4-g32", "int4-g64", "int4-g128"]
DTYPES = [torch.float32, torch.bfloat16]


def _weight(n: int, k: int, fmt: QuantFormat, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # groups off centre, so int4's minimums matter (a sign error in the min term cannot cancel out)
    return quantize(torch.randn(n, k, generator=g) + torch.rand(n, 1, generator=g), fmt)


# rows: one row (the decode tile), every tier's tile tails (12 and 8 rows on AVX512, 6 and 3 on AVX2, 4
# plain) and several tiles; n = 37: two whole panels and a partial one
@pytest.mark.parametrize("m", [1, 2, 5, 13, 64])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_quant_linear_equals_linear_of_the_dequantized_weight(tier, m, fmt, dtype, bias):
    n, k = 37, 256
    g = torch.Generator().manual_seed(m)
    tensors = _weight(n, k, fmt, seed=m)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = quant_linear(x, pack(tensors, fmt, n, k), fmt, n, b)
    assert got.shape == (m, n) and got.dtype == dtype
    want = F.linear(x.float(), dequantize(tensors, fmt), None if b is None else b.float())
    # float32 sums of the same products in another order (int4 also folds scale and minimum per group,
    # where the reference dequantizes every weight first): ~1e-6 relative per term, k terms; bfloat16
    # output is the float32 result rounded once (2^-8 relative)
    tol = 1e-4 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, atol=tol * k ** 0.5, rtol=tol)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_int8_with_an_odd_k_equals_linear(tier, m, dtype):
    # int8 takes any k; AVX512-BF16's bfloat16 path takes k in pairs, so an odd k goes the widened way
    fmt, n, k = QuantFormat.of("int8"), 21, 129
    tensors = _weight(n, k, fmt)
    x = torch.randn(m, k).to(dtype)
    got = quant_linear(x, pack(tensors, fmt, n, k), fmt, n, None)
    tol = 1e-4 if dtype == torch.float32 else 2 ** -8
    want = F.linear(x.float(), dequantize(tensors, fmt))
    torch.testing.assert_close(got.float(), want, atol=tol * k ** 0.5, rtol=tol)


# int4 groups whose k pairs are no multiple of the one-row tiles' unroll (group 12: 6 pairs, 20: 10), n past a
# panel's edge, and large off-centre weights and activations: the bfloat16 tier adds 128 x to each product
# (its nibbles are read as the bfloat16 128 + q) and takes it off once per group, which must not cost accuracy
@pytest.mark.parametrize("m", [1, 3, 14])
@pytest.mark.parametrize("group", [12, 20, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_int4_edge_groups_and_large_values_equal_linear(tier, m, group, dtype):
    fmt, n, k = QuantFormat.of("int4", group), 19, 3 * 320 // group * group
    g = torch.Generator().manual_seed(group + m)
    tensors = quantize(50 * torch.randn(n, k, generator=g) + 200 * torch.rand(n, 1, generator=g), fmt)
    x = (30 * torch.randn(m, k, generator=g) + 5).to(dtype)
    got = quant_linear(x, pack(tensors, fmt, n, k), fmt, n, None)
    want = F.linear(x.float(), dequantize(tensors, fmt))
    scale = F.linear(x.float().abs(), dequantize(tensors, fmt).abs())  # sum of |products|: what rounding scales with
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert ((got.float() - want).abs() <= tol * scale + 1e-3).all()


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=IDS[:2])
def test_quant_linear_with_several_threads_equals_one(tier, fmt):
    n, k = 1000, 256
    packed, x = pack(_weight(n, k, fmt), fmt, n, k), torch.randn(33, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear(x, packed, fmt, n, None)
        torch.set_num_threads(2)
        two = quant_linear(x, packed, fmt, n, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output column is computed by one thread in the same order


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("n", [1, 17, 37, 48])
@pytest.mark.parametrize("k", [128, 384, 640])
def test_pack_unpack_round_trip_and_packed_bytes(fmt, n, k):
    tensors = _weight(n, k, fmt)
    packed = pack(tensors, fmt, n, k)
    back = unpack(packed, fmt, n, k)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert packed_bytes(n, k, fmt) == sum(t.nbytes for t in packed.values())
    assert packed_bytes(n, k, fmt) >= fmt.stored_bytes(n, k)  # the padding of the last panel only


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("n", [37, 2 * rows_per_chunk(256) + 40])
def test_quantizing_by_chunks_gives_the_whole_layers_tensors(fmt, n):
    """What a layer stores, quantized and packed a chunk of rows at a time, is the whole layer's pack(quantize()),
    bit for bit."""
    w = torch.randn(n, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = _chunks_of(lambda: pack(quantize(w, fmt), fmt, n, 256))
    for name, t in quantize_packed(w, fmt).items():
        assert t.dtype == whole[name].dtype and torch.equal(t, whole[name]), name
    rows = _chunks_of(lambda: quantize(w, fmt))
    for name, t in quantize(w, fmt).items():  # the row-major form, chunk by chunk too
        assert torch.equal(t, rows[name]), name


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_a_layers_panels_made_by_chunks_equal_the_whole_layers(dtype):
    """The compute dtype's panels (PanelWeight), packed a chunk of rows at a time from a bfloat16 checkpoint
    tensor, are pack_panels of the whole weight."""
    from runner_core.kernels import pack_panels
    from runner_core.layers.weight_storage import PanelWeight

    n, k = 2 * rows_per_chunk(96) + 40, 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    storage = PanelWeight(n, k, dtype)
    storage.store(w)
    assert torch.equal(storage.panels, pack_panels(w.to(dtype)))


def _chunks_of(fn):
    """fn() with chunks larger than any layer: the whole layer at once."""
    import runner_core.layers.quantization as quantization

    saved, quantization.CHUNK_BYTES = quantization.CHUNK_BYTES, 1 << 40
    try:
        return fn()
    finally:
        quantization.CHUNK_BYTES = saved


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_dequantize_rows_equals_rows_of_the_dequantized_weight(fmt, dtype):
    n, k = 37, 256
    tensors = _weight(n, k, fmt)
    rows = torch.tensor([0, 36, 15, 16, 5, 5, 31])
    got = dequantize_rows(pack(tensors, fmt, n, k), fmt, rows, k, dtype)
    assert got.shape == (len(rows), k) and got.dtype == dtype
    assert torch.equal(got, dequantize(tensors, fmt, dtype)[rows])


def test_quant_linear_in_a_compiled_graph_is_the_opaque_op():
    fmt, n, k = QuantFormat.of("int4", 64), 40, 128
    packed = pack(_weight(n, k, fmt), fmt, n, k)
    bias = torch.randn(n)

    def layer(x):
        return torch.relu(quant_linear(x, packed, fmt, n, bias))

    x = torch.randn(5, k)
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    # traced with fake tensors (the registered fake gives the output's shape), the op stays one opaque call
    gm = make_fx(lambda x, b, *parts: quant_linear(x, dict(zip(packed, parts)), fmt, n, b),
                 tracing_mode="fake")(x, bias, *packed.values())
    assert "runner_kernels.quant_linear" in gm.code and "aten" not in gm.code


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=IDS[:2])
def test_pack_under_fake_tensors_gives_the_real_shapes(fmt):
    tensors = _weight(37, 128, fmt)
    real = pack(tensors, fmt, 37, 128)
    with FakeTensorMode() as mode:
        fake = pack({name: mode.from_tensor(t) for name, t in tensors.items()}, fmt, 37, 128)
    assert {name: (t.shape, t.dtype) for name, t in fake.items()} == {name: (t.shape, t.dtype)
                                                                        for name, t in real.items()}


def test_bad_input_is_refused_with_the_problem_named():
    fmt, n, k = QuantFormat.of("int4", 64), 20, 128
    tensors = _weight(n, k, fmt)
    packed = pack(tensors, fmt, n, k)
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16"):
        quant_linear(torch.zeros(1, k, dtype=torch.float16), packed, fmt, n, None)
    with pytest.raises(RuntimeError, match="k=96 is not a multiple of the int4 group size 64"):
        quant_linear(torch.zeros(1, 96), packed, fmt, n, None)
    with pytest.raises(RuntimeError, match=r"must be pack_quantized of an \[n, k\] = \[20, 192\]"):
        quant_linear(torch.zeros(1, 192), packed, fmt, n, None)
    with pytest.raises(RuntimeError, match=r"must be pack_quantized of an \[n, k\] = \[40, 128\]"):
        quant_linear(torch.zeros(1, k), packed, fmt, 40, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[n\] = \[20\] in x's dtype"):
        quant_linear(torch.zeros(1, k), packed, fmt, n, torch.zeros(n, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"\[20, 128\] int8 weight, got Byte"):  # int4 panels read as int8
        quant_linear(torch.zeros(1, k), packed, QuantFormat.of("int8"), n, None)
    with pytest.raises(ValueError, match="k=96 is not a multiple of the int4 group size 64"):
        pack(tensors, fmt, n, 96)
    with pytest.raises(ValueError, match=r"qweight is \(20, 64\), but an \[n, k\] = \[21, 128\] int4 weight"):
        pack(tensors, fmt, 21, k)
    with pytest.raises(RuntimeError, match=r"scales must be float32 \[n, k / group\] = \[20, 2\]"):
        pack({**tensors, "scales": tensors["scales"].double()}, fmt, n, k)
    with pytest.raises(RuntimeError, match="qweight must be a 2-D int8"):
        pack(tensors, QuantFormat.of("int8"), n, 64)
