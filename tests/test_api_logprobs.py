"""Logprobs over the API under the official `openai` client: completions (`logprobs`, `echo`, vLLM's
`prompt_logprobs`) and chat (`logprobs`, `top_logprobs` up to 20), streamed and not, equal to the engine's own
logprobs of the same greedy generation; 21 and the other bad combinations are a 400 naming the field."""

from __future__ import annotations

import math

import openai
import pytest

PROMPT = "Once upon a time"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "user", "content": "tell me a story"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer(api_session):
    return api_session.models["tiny-llama"].runner.tokenizer


@pytest.fixture
def chat_ids(tokenizer):
    """The chat prompt's token ids, with a chat template set for the test."""
    hf = tokenizer.hf
    hf.chat_template = TEMPLATE
    yield hf.encode(hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)
    hf.chat_template = None


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:k]


def _assert_completion_logprobs(lp, tokenizer, ids, entries, k, offset=0):
    """A completion's `logprobs` object written from the engine's token ids and {id: logprob} entries."""
    assert lp.tokens == [_text(tokenizer, t) for t in ids]
    for got, token, entry in zip(lp.token_logprobs, ids, entries):
        assert (got is None) if entry is None else math.isclose(got, entry[token], abs_tol=1e-5)
    for got, entry in zip(lp.top_logprobs, entries):
        if entry is None:
            assert got is None
            continue
        texts = [(_text(tokenizer, i), v) for i, v in _top(entry, k)]
        assert set(got) == {t for t, _ in texts}
        for t in got:  # a text two tokens share holds one of their values
            assert any(math.isclose(got[t], w, abs_tol=1e-5) for u, w in texts if u == t)
    starts = [offset]
    for token in lp.tokens[:-1]:
        starts.append(starts[-1] + len(token))
    assert lp.text_offset == starts


def test_completion_logprobs_equal_the_engines_streamed_and_not(api_session, api_client, tokenizer):
    expected = api_session.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    got = api_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=10, logprobs=3, **GREEDY)
    choice = got.choices[0]
    assert choice.text == expected.text
    _assert_completion_logprobs(choice.logprobs, tokenizer, expected.token_ids, expected.logprobs, 3)
    # greedy: each chosen token is its position's most likely one
    assert all(math.isclose(lp, max(top.values()), abs_tol=1e-6)
               for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))

    chunks = list(api_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=10, logprobs=3,
                                            stream=True, **GREEDY))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [t for p in pieces for t in p.tokens] == choice.logprobs.tokens
    assert [v for p in pieces for v in p.token_logprobs] == choice.logprobs.token_logprobs
    assert [v for p in pieces for v in p.top_logprobs] == choice.logprobs.top_logprobs
    assert [v for p in pieces for v in p.text_offset] == choice.logprobs.text_offset


def test_echo_returns_the_prompt_and_its_logprobs_before_the_output(api_session, api_client, tokenizer):
    expected = api_session.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                                prompt_logprobs=2)
    got = api_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6, logprobs=2, echo=True,
                                    **GREEDY)
    choice = got.choices[0]
    assert choice.text == PROMPT + expected.text
    ids = expected.prompt_token_ids + expected.token_ids
    _assert_completion_logprobs(choice.logprobs, tokenizer, ids, expected.prompt_logprobs + expected.logprobs, 2)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None

    chunks = list(api_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6, logprobs=2,
                                            echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs


def test_prompt_logprobs_by_token_id(api_session, api_client, tokenizer):
    expected = api_session.generate(PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=4)
    got = api_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 4})
    choice = got.choices[0]
    assert choice.logprobs is None
    prompt = choice.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(expected.prompt_token_ids)
    for got_entry, entry in zip(prompt[1:], expected.prompt_logprobs[1:]):
        assert {int(i) for i in got_entry} == set(entry)
        for i, value in got_entry.items():
            assert math.isclose(value["logprob"], entry[int(i)], abs_tol=1e-5)
            assert value["decoded_token"] == _text(tokenizer, int(i))


def test_chat_logprobs_with_20_top_tokens_streamed_and_not(api_session, api_client, tokenizer, chat_ids):
    expected = api_session.generate(chat_ids, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=20)
    got = api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=8, logprobs=True,
                                         top_logprobs=20, **GREEDY)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == expected.text and len(content) == 8
    for item, token, entry in zip(content, expected.token_ids, expected.logprobs):
        assert item.token == _text(tokenizer, token) and item.bytes == list(item.token.encode())
        assert math.isclose(item.logprob, entry[token], abs_tol=1e-5)
        assert [t.token for t in item.top_logprobs] == [_text(tokenizer, i) for i, _ in _top(entry, 20)]
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob, abs_tol=1e-6)  # greedy: the argmax
        assert all(a.logprob >= b.logprob for a, b in zip(item.top_logprobs, item.top_logprobs[1:]))

    chunks = list(api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=8,
                                                 logprobs=True, top_logprobs=20, stream=True, **GREEDY))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]
    assert all(len(i.top_logprobs) == 20 for i in streamed)


def test_chat_logprobs_without_top_logprobs_give_the_chosen_token_alone(api_client, chat_ids):
    got = api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=3, logprobs=True,
                                         **GREEDY)
    assert [item.top_logprobs for item in got.choices[0].logprobs.content] == [[], [], []]
    plain = api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=3, **GREEDY)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("call, param", [
    ({"chat": True, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"chat": True, "top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
], ids=["top_logprobs-21", "top_logprobs-without-logprobs", "logprobs-21", "prompt_logprobs-negative"])
def test_bad_logprob_fields_are_a_400_naming_the_field_and_the_fix(api_client, chat_ids, call, param):
    call = dict(call)
    with pytest.raises(openai.BadRequestError) as err:
        if call.pop("chat", False):
            api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2, **call)
        else:
            api_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, **call)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param
    assert param in body["message"] and ("0 to 20" in body["message"] or "logprobs: true" in body["message"])
