"""Fuzzing (hypothesis): configs, sampling parameters, prompts and multimodal inputs. The only outcomes
are a result or the documented error of the input (docs/reliability.md, "How failures are reported"): ConfigError
for a config, InvalidRequestError for a request, whose message names the offending field (or, for a
prompt, what is wrong with it). In a batch, an output with finish_reason "error" must be the refusal
the engine gives that prompt on its own; an accepted request that fails inside a step ("RuntimeError:
...") fails the test. Never another exception type, a hang (pytest-timeout) or a dead engine (every
example leaves it idle, with no KV block held, and a clean request still answers).

`make test` runs a small budget; `make fuzz` (RUNNER_FUZZ_EXAMPLES=500) the full one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner_core import ModelRunner, RunnerConfig, SamplingParams
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


# what a refused prompt's message is about (runner_core/engine/input_processor.py, multimodal.py, engine.py)
PROMPT_SUBJECTS = ("prompt", "token id", "image", "multi_modal_data", "input_ids")


def assert_names(message: str, subjects) -> None:
    """The error message names one of `subjects` (the offending fields or what was given)."""
    subjects = list(subjects)
    assert any(s in message for s in subjects), f"{message!r} names none of {subjects}"


def sampling_subjects(kwargs: dict) -> list[str]:
    """How a SamplingParams refusal names a field and the value it got."""
    return [f"SamplingParams.{k} got {v!r}" for k, v in kwargs.items()]


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_FIELDS) | st.text(max_size=12), values, max_size=6))
def test_runner_config_dicts(d):
    try:
        config = RunnerConfig(d)
    except ConfigError as e:  # the field or unknown key at fault, by name (or the missing 'model')
        assert_names(str(e), [repr(k) for k in d] + ([] if "model" in d else ["'model'"]))
    else:
        assert config.to_dict().keys() == set(CONFIG_FIELDS)


@FUZZ
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=5))
def test_sampling_params(kwargs):
    try:
        SamplingParams(**kwargs)
    except InvalidRequestError as e:
        assert_names(str(e), sampling_subjects(kwargs))


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "max_model_len": 96,
                        "kv_cache_memory": 1 << 22}).load_model()


token_ids = st.lists(st.one_of(st.integers(-5, 600), st.booleans(), st.floats(), st.text(max_size=2)), max_size=12)
text = st.one_of(st.text(max_size=40), st.text(st.characters(codec="utf-8", categories=["Cc", "Cs", "Zs", "So"]),
                                               max_size=40),
                 st.just("x" * 5000), st.just(""))
tensors = st.builds(lambda ids: torch.tensor(ids, dtype=torch.long), st.lists(st.integers(-3, 600), max_size=6))
in_vocab = st.lists(st.integers(0, 511), min_size=1, max_size=12)  # tiny-llama's 512 ids: prompts that run
prompt = st.one_of(text, token_ids, in_vocab, st.binary(max_size=12), tensors,
                   st.fixed_dictionaries({}, optional={"prompt": text, "prompt_token_ids": token_ids,
                                                       "multi_modal_data": values, "extra": values}),
                   st.dictionaries(st.integers() | st.text(max_size=3), values, max_size=2))
prompts = st.one_of(prompt, st.lists(prompt, min_size=1, max_size=4))
# valid settings too, so that most examples reach the engine's step and not only SamplingParams' checks
valid_sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 600),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**64 - 1), "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "stop_token_ids": st.lists(st.integers(0, 600)),
    "logprobs": st.none() | st.integers(0, 600), "min_tokens": st.integers(0, 3)})
sampling = st.one_of(st.none(), valid_sampling, st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=3))


def assert_engine_alive(runner, clean_tokens):
    engine = runner._engine()
    assert not engine.has_unfinished_requests()
    assert runner.memory_stats()["blocks_used"] == 0
    assert runner.generate("a b c", SMALL)[0].token_ids == clean_tokens


def batch_items(p) -> list:
    """The requests runner.generate makes of `p` (its docstring): a tensor's rows; one str, prompt
    dict or token-id list; otherwise each element of a sequence is a prompt."""
    if isinstance(p, torch.Tensor):
        return (p.unsqueeze(0) if p.dim() == 1 else p).tolist()
    if isinstance(p, (str, Mapping)) or (isinstance(p, list) and p and isinstance(p[0], int)):
        return [p]
    return list(p)


def refusal_alone(runner, prompt, params) -> str | None:
    """The InvalidRequestError message the engine gives `prompt` on its own; None if it accepts it
    (the accepted request is aborted again)."""
    engine = runner._engine()
    try:
        request_id = engine.add_request(prompt, params).request_id
    except InvalidRequestError as e:
        return str(e)
    engine.abort_request(request_id)
    return None


def check_outcome(runner, p, params, outs) -> None:
    """Each output of generate(p) finished; an error is the documented refusal of that prompt alone."""
    outs = outs["outputs"] if isinstance(outs, dict) else outs
    items = batch_items(p)
    assert len(outs) == len(items), "one output per prompt"
    for item, o in zip(items, outs):
        assert o.finish_reason in ("stop", "length", "error"), o.finish_reason
        if o.finish_reason == "error":
            refusal = refusal_alone(runner, item, params)
            assert refusal is not None, f"an accepted request failed inside a step: {o.error}"
            assert o.error == refusal
            assert_names(refusal, PROMPT_SUBJECTS)
        else:
            assert o.error is None and len(o.token_ids) <= params.max_tokens


@FUZZ
@given(prompts, sampling)
def test_prompts_and_sampling_never_break_the_engine(runner, p, kwargs):
    clean = runner.generate("a b c", SMALL)[0].token_ids
    params = None
    try:
        params = SMALL if kwargs is None else SMALL.replace(**kwargs)
        params = params.replace(max_tokens=min(params.max_tokens, 4))
        outs = runner.generate(p, params)
    except InvalidRequestError as e:  # a bad sampling field, or the only prompt is refused
        assert_names(str(e), sampling_subjects(kwargs or {}) if params is None else PROMPT_SUBJECTS)
    else:
        check_outcome(runner, p, params, outs)
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
        outs = llava.generate(p, SMALL)
    except InvalidRequestError as e:  # the only prompt is refused
        assert_names(str(e), PROMPT_SUBJECTS)
    else:
        check_outcome(llava, p, SMALL, outs)
    assert_engine_alive(llava, clean)
