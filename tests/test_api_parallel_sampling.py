"""Parallel sampling over the API under the official `openai` client: `n` on completions and chat
(`choices[i].index`), streamed chunks by choice index, usage counting every choice's tokens, logprobs per choice,
`best_of` (the n best by cumulative logprob; not streamed), and a seed giving the same completions as the engine
(the session's own `generate`)."""

from __future__ import annotations

import math

import openai
import pytest

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "tell me a story"}]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SAMPLED = {"max_tokens": 8, "seed": 17, "temperature": 1.0}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


@pytest.fixture
def chat_template(api_session):
    hf = api_session.models["tiny-llama"].runner.tokenizer.hf
    hf.chat_template = TEMPLATE
    yield
    hf.chat_template = None


def _engine(api_session, prompt, **params):
    """The session's own generation of the same request (its completions by index)."""
    return api_session.generate(prompt, ignore_eos=True, **params).outputs


def test_completions_n_gives_the_engines_completions_by_index(api_client, api_session):
    resp = api_client.completions.create(model="tiny-llama", prompt=PROMPT, n=3, **SAMPLED, **IGNORE_EOS)
    engine = _engine(api_session, PROMPT, n=3, **SAMPLED)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [c.text for c in engine]
    assert len({c.text for c in resp.choices}) == 3
    assert resp.usage.completion_tokens == 3 * SAMPLED["max_tokens"]
    assert all(c.finish_reason == "length" for c in resp.choices)


def test_streamed_chunks_carry_their_choice_index(api_client, api_session):
    stream = api_client.completions.create(model="tiny-llama", prompt=PROMPT, n=2, stream=True,
                                       stream_options={"include_usage": True}, **SAMPLED, **IGNORE_EOS)
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        assert len(chunk.choices) <= 1  # one choice per chunk
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    engine = _engine(api_session, PROMPT, n=2, **SAMPLED)
    assert [texts[0], texts[1]] == [c.text for c in engine]
    assert reasons == {0: "length", 1: "length"} and usage.completion_tokens == 2 * SAMPLED["max_tokens"]


def test_chat_n_streamed_and_not(api_client, api_session, chat_template):
    resp = api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, n=2, **SAMPLED, **IGNORE_EOS)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 2 * SAMPLED["max_tokens"]
    streamed = {0: "", 1: ""}
    roles = set()
    for chunk in api_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, n=2, stream=True, **SAMPLED,
                                                **IGNORE_EOS):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1}
    assert [streamed[0], streamed[1]] == [c.message.content for c in resp.choices]


def test_logprobs_per_choice(api_client, api_session):
    resp = api_client.completions.create(model="tiny-llama", prompt=PROMPT, n=2, logprobs=2, **SAMPLED, **IGNORE_EOS)
    engine = _engine(api_session, PROMPT, n=2, logprobs=2, **SAMPLED)
    for choice, done in zip(resp.choices, engine):
        expected = [e[t] for t, e in zip(done.token_ids, done.logprobs)]
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(choice.logprobs.token_logprobs, expected))
        assert len(choice.logprobs.top_logprobs) == SAMPLED["max_tokens"]


def test_best_of_returns_the_n_best_and_does_not_stream(api_client, api_session):
    resp = api_client.completions.create(model="tiny-llama", prompt=PROMPT, n=2, best_of=5, **SAMPLED, **IGNORE_EOS)
    every = _engine(api_session, PROMPT, n=5, logprobs=0, **SAMPLED)
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.text for c in resp.choices] == [c.text for c in ranked] and [c.index for c in resp.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as err:
        api_client.completions.create(model="tiny-llama", prompt=PROMPT, n=2, best_of=5, stream=True, **SAMPLED)
    assert err.value.body["param"] == "best_of" and "cannot stream" in err.value.body["message"]


def test_n_beyond_max_num_seqs_is_a_400_naming_the_fix(api_client):
    with pytest.raises(openai.BadRequestError) as err:
        api_client.completions.create(model="tiny-llama", prompt=PROMPT, n=1000, max_tokens=2)
    assert "raise max_num_seqs" in err.value.body["message"]
