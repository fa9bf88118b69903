"""Structured outputs (engine/structured_output.py): each kind of constraint holds on tiny-llama's random-weight
output (a JSON Schema answer validates, a regex matches, a choice is one of them, a grammar's language); a schema
or grammar the engine cannot compile is refused naming the problem, in the engine and as a 400 over the API
(official `openai` client); unconstrained requests batched beside constrained ones keep their tokens; preemption
and chunked prefill keep the matcher in step with the output."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from runner_core import InvalidRequestError, ModelRunner, SamplingParams
from runner_core import StructuredOutputsParams as SO
from tests.sessions import TINY, tiny_session

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog"]}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
GBNF = 'root ::= "x" [0-9] [0-9]? "!"'


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    r = ModelRunner({"model": str(tiny_llama_path), **TINY}).load_model()
    yield r
    r.shutdown()


def _constrained(so: SO, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 0, **kw}, structured_outputs=so)


def test_each_kind_of_constraint_holds_greedy_and_sampled(runner):
    params = [_constrained(SO(json=SCHEMA)), _constrained(SO(json=json.dumps(SCHEMA)), temperature=1.0, seed=3),
              _constrained(SO(regex=REGEX)), _constrained(SO(regex=REGEX), temperature=1.0, seed=5),
              _constrained(SO(choice=CHOICES)), _constrained(SO(choice=CHOICES), temperature=1.0, seed=7),
              _constrained(SO(grammar=GBNF)), _constrained(SO(grammar='start: "ab" | "cd"'))]
    outs = runner.generate(["Once upon a time"] * len(params), params)
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert all(re.fullmatch(REGEX, o.text) for o in outs[2:4])
    assert all(o.text in CHOICES for o in outs[4:6])
    assert re.fullmatch(r"x[0-9]{1,2}!", outs[6].text) and outs[7].text in ("ab", "cd")


def test_any_json_object_is_an_object_or_ends_with_length(runner):
    outs = runner.generate(["Once upon a time", "The"], [_constrained(SO(json_object=True), temperature=1.0, seed=s)
                                                         for s in (1, 2)])
    for o in outs:
        assert o.text.startswith("{")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length"


def test_running_out_of_max_tokens_says_length(runner):
    (out,) = runner.generate(["Once upon a time"], [_constrained(SO(json=SCHEMA), max_tokens=3)])
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_unconstrained_requests_beside_constrained_ones_keep_their_tokens(runner):
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)]
    prompts = ["Once upon a time", "A list of"]
    alone = runner.generate(prompts, free)
    constrained = [_constrained(SO(regex=REGEX)), _constrained(SO(json=SCHEMA))]
    mixed = runner.generate(prompts + ["The"] * 2, free + constrained)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


@pytest.mark.parametrize("so, problem", [
    (SO(json={"type": "nonsense"}), "json cannot be compiled.*nonsense"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(regex="[a-"), "regex cannot be compiled.*unclosed character class"),
    (SO(grammar="root ::= ("), "grammar.*Lark or GBNF"),
    (SO(grammar="start: undefined_rule"), "grammar cannot be compiled"),
])
def test_a_constraint_the_engine_cannot_compile_is_refused_naming_it(runner, so, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        runner.generate("hi", _constrained(so))


def test_bad_structured_output_params_are_refused_at_construction():
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        SO(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        SO()
    with pytest.raises(InvalidRequestError, match="choice"):
        SO(choice=[])
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a"))


def test_preemption_and_chunked_prefill_keep_the_grammar_in_step(tiny_llama_path):
    # a pool of ~300 tokens for six 100-token prompts: requests are preempted (recomputed); prompts run in chunks
    config = {**TINY, "kv_cache_memory": 300 * 2048, "max_num_batched_tokens": 48, "max_num_seqs": 6}
    r = ModelRunner({"model": str(tiny_llama_path), **config}).load_model()
    try:
        prompts = [[5 + i] + list(range(10, 109)) for i in range(6)]
        outs = r.generate(prompts, [_constrained(SO(regex=r"[a-z]{30,40}\."), temperature=1.0, seed=i)
                                    for i in range(6)])
    finally:
        r.shutdown()
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert all(o.finish_reason == "stop" and re.fullmatch(r"[a-z]{30,40}\.", o.text) for o in outs)


# ---- over the API -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_llama_path):
    for session in tiny_session():
        session.models["tiny-llama"].runner.tokenizer.hf.chat_template = (
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
        server = session.serve_api()
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        server.stop()


def test_response_format_json_schema_on_chat_and_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "who?"}],
                                          max_tokens=80, temperature=0, response_format=fmt)
    done = client.completions.create(model="tiny-llama", prompt="Once", max_tokens=80, temperature=0,
                                     extra_body={"response_format": fmt})
    for text, reason in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                         (done.choices[0].text, done.choices[0].finish_reason)):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_extra_parameters_constrain_completions(client):
    def text(**extra):
        got = client.completions.create(model="tiny-llama", prompt="Once", max_tokens=80, temperature=0.8, seed=1,
                                        extra_body=extra)
        assert got.choices[0].finish_reason == "stop"
        return got.choices[0].text

    assert re.fullmatch(REGEX, text(guided_regex=REGEX))
    assert text(guided_choice=CHOICES) in CHOICES
    assert re.fullmatch(r"x[0-9]{1,2}!", text(guided_grammar=GBNF))
    jsonschema.validate(json.loads(text(guided_json=SCHEMA)), SCHEMA)
    assert text(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")


@pytest.mark.parametrize("extra, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "cannot be compiled.*nonsense"),
    ({"guided_regex": "[a-"}, "unclosed character class"),
    ({"guided_grammar": "root ::= ("}, "Lark or GBNF"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output constraint"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_a_bad_constraint_is_a_400_naming_the_problem(client, extra, problem):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt="Once", max_tokens=8, extra_body=extra)
    assert err.value.status_code == 400 and re.search(problem, err.value.body["message"])
