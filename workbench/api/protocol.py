"""The API's request bodies and response objects, with OpenAI's field names (and vLLM's extensions
`top_k` and `ignore_eos`, and its structured-output parameters). Pydantic checks types and ranges, so a bad field is
a 400 naming it."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from runner_core import InvalidRequestError, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that follows `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra parameter: one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(BaseModel):
    """The fields both endpoints share; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | bool | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* parameters
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_fields(self) -> dict:
        """SamplingParams fields (max_tokens is the endpoint's to decide)."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
                  "stop": self.stop, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "n": self.n}
        if self.top_k is not None:
            fields["top_k"] = self.top_k
        return fields

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request gives (InvalidRequestError when it gives several, or a bad one)."""
        given = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise _refused("response_format", "type 'json_schema' needs response_format.json_schema.schema")
            given["response_format"] = {"json": fmt.json_schema.schema_}
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            given["structured_outputs"] = {"json" if k == "json_" else k: v for k, v in fields.items()}
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                given[f"guided_{kind}"] = {kind: getattr(self, f"guided_{kind}")}
        if not given:
            return None
        if len(given) > 1:
            raise _refused(next(iter(given)), f"give one structured-output constraint; got {', '.join(given)}")
        return StructuredOutputsParams(**next(iter(given.values())))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of one of those (one prompt per request)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)  # the n of best_of completions with the highest cumulative logprob
    prompt_logprobs: int | None = None  # vLLM's extension: logprobs of the prompt's tokens

    def sampling_fields(self) -> dict:
        return {**super().sampling_fields(), "best_of": self.best_of}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls...: handed to the chat template as given

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None


def _refused(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, spec: dict | None = None) -> dict:
    """OpenAI's usage object. With `spec` (a request's SpecDecodingStats as a dict: speculation verified drafts
    for it) two additions a client that does not know them ignores: OpenAI's `completion_tokens_details` with
    the draft tokens accepted and rejected (its names for predicted outputs, the same idea), and the extension
    `spec_decoding` with the drafts, the draft tokens, the accepted ones in all and by position, and the mean
    acceptance length (the tokens a verified step gave, the bonus one included)."""
    use = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if spec:
        drafted, accepted = spec["num_draft_tokens"], spec["num_accepted_tokens"]
        use["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
        use["spec_decoding"] = {key: spec[key] for key in SPEC_USAGE_KEYS}
    return use


SPEC_USAGE_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                   "mean_acceptance_length")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


