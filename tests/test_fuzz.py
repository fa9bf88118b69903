"""Fuzzing (hypothesis): configs, sampling parameters, prompts and multimodal inputs. The only outcomes
are a result or one of the project's documented errors (runner_core.errors) with a message; never
another exception type, a hang (pytest-timeout) or a dead engine (every example leaves it idle, with
no KV block held, and a clean request still answers).

`make test` runs a small budget; `make fuzz` (RUNNER_FUZZ_EXAMPLES=500) the full one.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner_core import ModelRunner, RunnerConfig, RunnerError, SamplingParams
from runner_core.errors import ConfigError, InvalidRequestError

EXAMPLES = int(os.environ.get("RUNNER_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("CI") == "true",
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SMALL = SamplingParams(max_tokens=3, temperature=0.0)

# any JSON-ish value, plus the kinds of Python values a notebook user passes by mistake
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                              max_size=3), max_leaves=6)
CONFIG_FIELDS = [f.name for f in dataclasses.fields(RunnerConfig)]
SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def documented(exc: BaseException) -> bool:
    return isinstance(exc, RunnerError) and len(str(exc)) > 10


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_FIELDS) | st.text(max_size=12), values, max_size=6))
def test_runner_config_dicts(d):
    try:
        config = RunnerConfig(d)
    except ConfigError as e:
        assert documented(e), repr(e)
    else:
        assert config.to_dict().keys() == set(CONFIG_FIELDS)


@FUZZ
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=5))
def test_sampling_params(kwargs):
    try:
        SamplingParams(**kwargs)
    except InvalidRequestError as e:
        assert documented(e), repr(e)


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "max_model_len": 96,
                        "kv_cache_memory": 1 << 22}).load_model()


token_ids = st.lists(st.one_of(st.integers(-5, 600), st.booleans(), st.floats(), st.text(max_size=2)), max_size=12)
text = st.one_of(st.text(max_size=40), st.text(st.characters(codec="utf-8", categories=["Cc", "Cs", "Zs", "So"]),
                                               max_size=40),
                 st.just("x" * 5000), st.just(""))
tensors = st.builds(lambda ids: torch.tensor(ids, dtype=torch.long), st.lists(st.integers(-3, 600), max_size=6))
prompt = st.one_of(text, token_ids, st.binary(max_size=12), tensors,
                   st.fixed_dictionaries({}, optional={"prompt": text, "prompt_token_ids": token_ids,
                                                       "multi_modal_data": values, "extra": values}),
                   st.dictionaries(st.integers() | st.text(max_size=3), values, max_size=2))
prompts = st.one_of(prompt, st.lists(prompt, min_size=1, max_size=4))
sampling = st.one_of(st.none(), st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=3))


def assert_engine_alive(runner, clean_tokens):
    engine = runner._engine()
    assert not engine.has_unfinished_requests()
    assert runner.memory_stats()["blocks_used"] == 0
    assert runner.generate("a b c", SMALL)[0].token_ids == clean_tokens


@FUZZ
@given(prompts, sampling)
def test_prompts_and_sampling_never_break_the_engine(runner, p, kwargs):
    clean = runner.generate("a b c", SMALL)[0].token_ids
    try:
        params = SMALL if kwargs is None else SMALL.replace(**kwargs)
        outs = runner.generate(p, params.replace(max_tokens=min(params.max_tokens, 4)))
    except InvalidRequestError as e:
        assert documented(e), repr(e)
    else:
        outs = outs["outputs"] if isinstance(outs, dict) else outs
        for o in outs:
            assert o.finish_reason in ("stop", "length", "error")
            assert o.finish_reason != "error" or documented(InvalidRequestError(o.error))
    assert_engine_alive(runner, clean)


@pytest.fixture(scope="module")
def llava():
    return ModelRunner({"model": "tiny-llava", "dtype": "float32", "max_model_len": 96}).load_model()


def _image(kind: str, size: int):
    from PIL import Image

    if kind == "pil":
        return Image.new("RGB", (size, size), (size % 255, 10, 200))
    if kind == "pil-l":
        return Image.new("L", (size, max(1, size // 3)))
    if kind == "array":
        return torch.rand(3, size, size).numpy()
    if kind == "tensor":
        return torch.rand(size, size, 3)
    return {"path": "/etc/passwd"} if kind == "dict" else "not an image"


images = st.builds(_image, st.sampled_from(["pil", "pil-l", "array", "tensor", "dict", "str"]), st.integers(1, 64))
mm_prompt = st.builds(lambda text, data: {"prompt": text, "multi_modal_data": data},
                      st.one_of(st.just("<image> describe"), st.just("<image><image> two"), st.just("no image"),
                                text),
                      st.one_of(st.fixed_dictionaries({"image": st.one_of(images, st.lists(images, max_size=3))}),
                                values))


@FUZZ
@given(st.one_of(mm_prompt, st.lists(mm_prompt, min_size=1, max_size=3)))
def test_multimodal_inputs_never_break_the_engine(llava, p):
    clean = llava.generate("a b c", SMALL)[0].token_ids
    try:
        llava.generate(p, SMALL)
    except InvalidRequestError as e:
        assert documented(e), repr(e)
    assert_engine_alive(llava, clean)
