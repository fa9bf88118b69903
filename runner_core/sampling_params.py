"""`SamplingParams`: how one request picks its tokens (vLLM's names), validated on
construction; a bad value raises `InvalidRequestError` naming the field and the range. Its
`structured_outputs` (`StructuredOutputsParams`, vLLM's name) constrains the output to a JSON Schema, any JSON
object, a regular expression, a choice among strings or a grammar; whether the engine can compile it is
checked when the request is submitted (engine/structured_output.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from runner_core.errors import InvalidRequestError


def _bad(name: str, value: Any, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.{name} got {value!r}; allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `StructuredOutputsParams`); exactly one field is set.

    `json`: a JSON Schema (a dict or its JSON text); `json_object`: any JSON object; `regex`: a regular
    expression the whole output matches; `choice`: one of these strings, exactly; `grammar`: a Lark grammar
    (llguidance's dialect, `start` its root) or a GBNF one (llama.cpp's, `root ::= ...`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"StructuredOutputsParams needs exactly one of {', '.join(self.KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise _bad("structured_outputs.json", self.json, "a JSON Schema: a dict or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else ()
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise _bad("structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if not isinstance(self.json_object, bool):
            raise _bad("structured_outputs.json_object", self.json_object, "True or False")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """Per-request sampling settings; `temperature=0` (or `top_k=1`) means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # parallel sampling (engine/parallel_sampling.py): n completions of the prompt, the n best of best_of
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an int >= 1")
        if not _is_number(self.temperature) or self.temperature < 0 or math.isinf(self.temperature):
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise _bad("top_k", self.top_k, "0 or -1 (disabled), or an int >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise _bad("seed", self.seed, "None or an int in [0, 2**64)")
        self._check_structured_outputs()
        self._check_parallel_sampling()
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"an int in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise _bad(name, value, "None or an int >= 0 (top logprobs per token)")

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise _bad("structured_outputs", so, "None or a StructuredOutputsParams")
        # a constrained output ends with EOS once its grammar is complete: nothing may hold it back
        if self.ignore_eos:
            raise _bad("ignore_eos", True, "False with structured_outputs (the output ends when its grammar does)")
        if self.min_tokens:
            raise _bad("min_tokens", self.min_tokens, "0 with structured_outputs (the grammar decides the length)")

    def _check_parallel_sampling(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an int >= 1 (the completions returned)")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise _bad("best_of", self.best_of, f"None or an int >= n={self.n} (the sequences run, of which the n "
                                                "with the highest cumulative logprob are returned); raise best_of "
                                                "or lower n")

    @property
    def num_sequences(self) -> int:
        """The sequences the request runs after its prompt: best_of if given, else n."""
        return self.n if self.best_of is None else self.best_of

    @staticmethod
    def _normalise_stop(stop: Iterable[str] | str | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        try:
            items = tuple(items)
        except TypeError:
            raise _bad("stop", stop, "None, a non-empty string or a list of non-empty strings") from None
        for item in items:
            if not isinstance(item, str) or not item:
                raise _bad("stop", stop, "None, a non-empty string or a list of non-empty strings")
        return items

    @staticmethod
    def _normalise_stop_token_ids(ids: Iterable[int]) -> tuple[int, ...]:
        try:
            items = tuple(ids)
        except TypeError:
            raise _bad("stop_token_ids", ids, "a list of ints >= 0") from None
        for item in items:
            if not _is_int(item) or item < 0:
                raise _bad("stop_token_ids", ids, "a list of ints >= 0")
        return items

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def replace(self, **changes: Any) -> SamplingParams:
        """A new validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)
