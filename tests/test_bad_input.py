"""Bad input is refused with a message naming the problem; in a batch it fails alone; the engine goes on."""

from __future__ import annotations

import pytest

from runner_core import ConfigError, EngineNotReadyError, InvalidRequestError, ModelRunner, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "max_model_len": 64,
                        "kv_cache_memory": 1 << 22}).load_model()


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "no prompts given"),
    ([5, 512, 7], "token id 512 at position 1 is outside the vocabulary [0, 512)"),
    ([5, -1], "token id -1 at position 1 is outside the vocabulary"),
    ("x" * 200, "max_model_len is 64"),
])
def test_bad_prompt_is_refused(runner, prompt, message):
    with pytest.raises(InvalidRequestError) as e:
        runner.generate(prompt, GREEDY)
    assert message in str(e.value)


def test_prompt_of_wrong_type_is_refused(runner):
    with pytest.raises(InvalidRequestError) as e:
        runner.add_request(3.5, GREEDY)
    assert "prompt must be a str, a list of token ids or a prompt dict, got float" in str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params_are_refused(runner, kwargs, message):
    with pytest.raises(InvalidRequestError) as e:
        runner.generate("hello", **kwargs)
    assert message in str(e.value) and repr(next(iter(kwargs.values()))) in str(e.value)


def test_bad_request_in_a_batch_fails_alone(runner):
    good = runner.generate(["fine", "also fine"], GREEDY)
    outs = runner.generate(["fine", "", [1, 99999], "also fine"], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "prompt is empty" in outs[1].error and "outside the vocabulary" in outs[2].error
    assert [outs[0].token_ids, outs[3].token_ids] == [g.token_ids for g in good]
    assert runner.generate("still works", GREEDY)[0].finish_reason == "length"
    assert runner.memory_stats()["blocks_used"] == 0


def test_bad_config_value_is_refused():
    with pytest.raises(ConfigError) as e:
        ModelRunner({"model": "tiny-llama", "block_size": 3})
    assert "block_size" in str(e.value) and "3" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ModelRunner({"model": "tiny-llama", "max_num_seq": 4})
    assert "did you mean 'max_num_seqs'" in str(e.value)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_path):
    with pytest.raises(ConfigError) as e:
        ModelRunner(model=str(tiny_llama_path), max_model_len=10**6).load_model()
    assert "max_position_embeddings" in str(e.value)


def test_pool_too_small_for_one_sequence_is_refused(tiny_llama_path):
    with pytest.raises(ConfigError) as e:
        ModelRunner(model=str(tiny_llama_path), max_model_len=512, kv_cache_memory=4096).load_model()
    assert "raise kv_cache_memory" in str(e.value)


def test_generate_before_load_says_what_to_do():
    with pytest.raises(EngineNotReadyError) as e:
        ModelRunner(model="tiny-llama").generate("hi")
    assert "load_model()" in str(e.value)


def test_configuration_that_cannot_fit_is_refused_before_loading(tiny_llama_path):
    runner = ModelRunner(model=str(tiny_llama_path), kv_cache_memory=64 << 40)  # a 64 TiB pool
    with pytest.raises(ConfigError) as e:
        runner.load_model()
    message = str(e.value)
    assert "need" in message and "available" in message and "kv_cache_memory" in message
    assert runner.engine is None
