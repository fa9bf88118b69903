"""SamplingParams validation and the batched Sampler (greedy, top-k/p, min-p, seeds, logprobs)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_core.errors import InvalidRequestError
from runner_core.layers.sampler import Sampler, SamplingMetadata
from runner_core.sampling_params import SamplingParams

# ---------------------------------------------------------------- SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, (), (), False)
    assert (p.min_tokens, p.logprobs, p.skip_special_tokens) == (0, None, True)
    assert not p.greedy


BAD_PARAMS = [
    ("max_tokens", 0, "an int >= 1"),
    ("max_tokens", -1, "an int >= 1"),
    ("max_tokens", 2.0, "an int >= 1"),
    ("temperature", -0.5, "a finite number >= 0"),
    ("temperature", math.inf, "a finite number >= 0"),
    ("temperature", math.nan, "a finite number >= 0"),
    ("temperature", True, "a finite number >= 0"),
    ("top_p", 0, "a number in (0, 1]"),
    ("top_p", 1.5, "a number in (0, 1]"),
    ("top_k", -2, "0 or -1 (disabled), or an int >= 1"),
    ("top_k", 1.0, "0 or -1 (disabled), or an int >= 1"),
    ("min_p", -0.1, "a number in [0, 1]"),
    ("min_p", 1.1, "a number in [0, 1]"),
    ("seed", -1, "None or an int in [0, 2**64)"),
    ("seed", "1", "None or an int in [0, 2**64)"),
    ("stop", "", "None, a non-empty string or a list of non-empty strings"),
    ("stop", ["ok", ""], "a list of non-empty strings"),
    ("stop", [3], "a list of non-empty strings"),
    ("stop", 5, "a list of non-empty strings"),
    ("stop_token_ids", [1, -1], "a list of ints >= 0"),
    ("stop_token_ids", 7, "a list of ints >= 0"),
    ("ignore_eos", "no", "True or False"),
    ("skip_special_tokens", 1, "True or False"),
    ("min_tokens", -1, "an int in [0, max_tokens=16]"),
    ("min_tokens", 17, "an int in [0, max_tokens=16]"),
    ("logprobs", -1, "None or an int >= 0"),
]


@pytest.mark.parametrize("field, value, allowed", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v, _ in BAD_PARAMS])
def test_bad_params_name_field_value_and_range(field, value, allowed):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message and allowed in message


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_normalisation():
    p = SamplingParams(stop="\n", stop_token_ids=[2, 3], temperature=1, top_p=1)
    assert p.stop == ("\n",) and p.stop_token_ids == (2, 3)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_min_tokens_may_equal_max_tokens():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


@pytest.mark.parametrize("kwargs, greedy", [
    ({"temperature": 0.0}, True), ({"top_k": 1}, True), ({"temperature": 0.7}, False),
    ({"top_k": 2}, False), ({"top_k": -1}, False),
])
def test_greedy_property(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_replace_validates():
    p = SamplingParams(max_tokens=8, seed=3)
    q = p.replace(temperature=0.0)
    assert (q.temperature, q.max_tokens, q.seed, p.temperature) == (0.0, 8, 3, 1.0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        p.replace(top_p=2.0)


def test_max_new_tokens_is_not_a_field():
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=4)


# ---------------------------------------------------------------- Sampler

VOCAB = 50
sampler = Sampler()


@pytest.fixture(autouse=True)
def fixed_global_seed():
    torch.manual_seed(1234)  # unseeded rows draw from the default generator


def run(logits, params, generators=None):
    generators = generators if generators is not None else [None] * len(params)
    meta = SamplingMetadata.build(params, generators, logits.shape[-1], logits.device)
    return sampler(logits, meta)


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def logits():
    return torch.randn(6, VOCAB, generator=gen(0)) * 3


def test_metadata_build():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.9, logprobs=3),
              SamplingParams(temperature=0.5, min_p=0.1, logprobs=99)]
    g = gen(1)
    meta = SamplingMetadata.build(params, [g, g, None], VOCAB, "cpu")
    assert meta.temperature.tolist() == [0.0, 1.0, 0.5]
    assert meta.top_k.tolist() == [VOCAB, 5, VOCAB] and meta.top_k.dtype == torch.int64
    assert meta.top_p.dtype == meta.min_p.dtype == meta.temperature.dtype == torch.float32
    assert meta.generators == {1: g}  # greedy rows need no generator
    assert not meta.all_greedy and not meta.all_random and not meta.no_top_p_top_k_min_p
    assert meta.max_num_logprobs == VOCAB  # capped at the vocabulary
    with pytest.raises(ValueError, match="2 SamplingParams but 1 generators"):
        SamplingMetadata.build(params[:2], [None], VOCAB, "cpu")


def test_metadata_fast_path_ignores_greedy_rows():
    params = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=-1)]
    meta = SamplingMetadata.build(params, [None, None], VOCAB, "cpu")
    assert meta.no_top_p_top_k_min_p and meta.max_num_logprobs is None


def test_greedy_equals_argmax(logits):
    out = run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None


def test_greedy_in_half_precision(logits):
    out = run(logits.to(torch.bfloat16), [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.sampled_token_ids, logits.to(torch.bfloat16).float().argmax(-1))


def test_top_k_1_equals_argmax(logits):
    out = run(logits, [SamplingParams(top_k=1, temperature=2.0)] * 6)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_top_token(logits):
    for _ in range(5):
        out = run(logits, [SamplingParams(top_p=1e-6, temperature=5.0)] * 6)
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_keeps_the_k_largest(logits):
    allowed = logits.topk(3, dim=-1).indices
    for _ in range(20):
        out = run(logits, [SamplingParams(top_k=3, temperature=10.0)] * 6)
        assert (allowed == out.sampled_token_ids.unsqueeze(1)).any(1).all()


@pytest.mark.parametrize("top_p, kept", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seen = set()
    for _ in range(400):
        seen.add(run(probs.log(), [SamplingParams(top_p=top_p)]).sampled_token_ids.item())
    assert seen == kept


def test_min_p_drops_tokens_below_fraction_of_the_top():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    seen = set()
    for _ in range(300):
        seen.add(run(probs.log(), [SamplingParams(min_p=0.6)]).sampled_token_ids.item())
    assert seen == {0, 1}  # 0.2 < 0.6 * 0.4 = 0.24


def test_mixed_greedy_and_random_rows(logits):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.5), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.9), SamplingParams(min_p=0.2)]
    out = run(logits, params)
    for row in (0, 1, 3):
        assert out.sampled_token_ids[row] == logits[row].argmax()
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < VOCAB)).all()


def sample_seeded_alone(row_logits, params, seed, steps):
    g = gen(seed)
    return [run(row_logits.unsqueeze(0), [params], [g]).sampled_token_ids.item() for _ in range(steps)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.3, seed=11),
                                    SamplingParams(top_k=10, top_p=0.8, min_p=0.05, seed=11)])
def test_seeded_row_is_independent_of_the_batch(logits, params):
    alone = sample_seeded_alone(logits[2], params, seed=11, steps=20)
    g_seeded, g_other = gen(11), gen(99)
    batch_params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=99), params,
                    SamplingParams(temperature=0.8), SamplingParams(top_p=0.5), SamplingParams()]
    generators = [None, g_other, g_seeded, None, None, None]
    in_batch = [run(logits, batch_params, generators).sampled_token_ids[2].item() for _ in range(20)]
    assert in_batch == alone
    assert len(set(alone)) > 1  # it really samples


def test_seeded_row_ignores_the_global_rng(logits):
    params = SamplingParams(temperature=1.0, seed=5)
    torch.manual_seed(1)
    first = sample_seeded_alone(logits[0], params, seed=5, steps=10)
    torch.manual_seed(2)
    assert sample_seeded_alone(logits[0], params, seed=5, steps=10) == first


@settings(max_examples=10, deadline=None)
@given(temperature=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 2**31))
def test_frequencies_match_softmax(temperature, seed):
    vocab, draws = 6, 30000
    row = torch.randn(vocab, generator=gen(seed))
    logits = row.expand(draws, vocab).contiguous()
    torch.manual_seed(seed)
    out = run(logits, [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    expected = torch.softmax(row.double() / temperature, -1) * draws
    mask = expected > 5
    chi2 = (((counts - expected) ** 2 / expected)[mask]).sum().item()
    assert chi2 < 40  # at most 5 degrees of freedom: a false alarm has p < 1e-6


def test_logprobs_shape_and_values(logits):
    params = [SamplingParams(logprobs=4), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(top_k=3)] + [SamplingParams(temperature=0.7)] * 3
    out = run(logits.to(torch.float16), params)
    assert out.logprob_token_ids.shape == out.logprobs.shape == (6, 5)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    raw = torch.log_softmax(logits.to(torch.float16).float(), -1)  # before temperature/top-k
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.logprobs[:, 1:], raw.gather(1, out.logprob_token_ids[:, 1:]))
    top = out.logprobs[:, 1:]
    assert (top[:, :-1] >= top[:, 1:]).all()  # sorted, best first
    assert torch.equal(out.logprob_token_ids[:, 1], logits.to(torch.float16).float().argmax(-1))


def test_zero_logprobs_returns_only_the_sampled_token(logits):
    out = run(logits, [SamplingParams(logprobs=0)] * 6)
    assert out.logprobs.shape == (6, 1)
