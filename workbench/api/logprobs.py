"""Logprobs over the API: the request's logprob fields checked and turned into SamplingParams' (`logprobs`,
`prompt_logprobs`; 0 to MAX_LOGPROBS top tokens, vLLM's default limit), and the engine's per-token
{token id: logprob} dicts written in OpenAI's shapes: a completion's `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset`, a chat message's `content[]` of `token` / `logprob` / `bytes` /
`top_logprobs[]`, and vLLM's `prompt_logprobs`. The values are the raw model's (docs/engine.md, Logprobs)."""

from __future__ import annotations

from workbench.api.errors import bad

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's chat allows 20 too
FLOOR = -9999.0  # what a -inf logprob (a masked token) is written as: JSON has no infinity (vLLM's choice)


def _count(param: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise bad(param, f"{param} is {value!r}; give an int from 0 to {MAX_LOGPROBS} (the most likely tokens "
                         f"returned per position; this server returns at most {MAX_LOGPROBS})")
    return value


def completion_fields(body) -> dict:
    """SamplingParams' logprob fields of a /v1/completions body: `logprobs` (an int, the top tokens per output
    token), vLLM's `prompt_logprobs`; with `echo` and `logprobs`, the prompt's too (its tokens are echoed)."""
    fields = {}
    if body.logprobs is not None:
        fields["logprobs"] = _count("logprobs", body.logprobs)
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = _count("prompt_logprobs", body.prompt_logprobs)
    if body.echo and "logprobs" in fields:
        fields["prompt_logprobs"] = max(fields["logprobs"], fields.get("prompt_logprobs", 0))
    return fields


def chat_fields(body) -> dict:
    """SamplingParams' `logprobs` of a /v1/chat/completions body: `logprobs` true, `top_logprobs` top tokens."""
    if body.logprobs not in (None, False, True):
        raise bad("logprobs", f"logprobs is {body.logprobs!r}; on /v1/chat/completions it is true or false, and "
                              f"top_logprobs (0 to {MAX_LOGPROBS}) says how many tokens per position")
    if body.top_logprobs is not None:
        top = _count("top_logprobs", body.top_logprobs)
        if not body.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true; send both")
        return {"logprobs": top}
    return {"logprobs": 0} if body.logprobs else {}


def top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely of one position's {token id: logprob} (the engine's holds the chosen token and
    the top k: the chosen one is left out unless it is among them)."""
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:k]


class TokenLogprobs:
    """One request's logprobs, written piece by piece (a stream's chunks, or the whole at the end) with
    `tokenizer`'s text of each token; `k` top tokens per position. `text_offset` runs on across pieces
    from `offset` (a completion's text so far)."""

    def __init__(self, tokenizer, k: int, offset: int = 0):
        self.tokenizer, self.k, self.offset = tokenizer, k, offset

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, ids: list[int], entries: list[dict[int, float] | None]) -> dict:
        """A completion's `logprobs` for these tokens; an entry of None (the prompt's first token) gives a
        null logprob and null top_logprobs."""
        tokens = [self._text(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else max(e[t], FLOOR) for t, e in zip(ids, entries)],
            "top_logprobs": [None if e is None else {self._text(i): max(v, FLOOR) for i, v in top(e, self.k)}
                             for e in entries],
            "text_offset": offsets,
        }

    def chat(self, ids: list[int], entries: list[dict[int, float]]) -> dict:
        """A chat choice's `logprobs` for these tokens: {"content": [...]}."""
        return {"content": [{**self._item(t, e[t]), "top_logprobs": [self._item(i, v) for i, v in top(e, self.k)]}
                            for t, e in zip(ids, entries)]}

    def _item(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(text.encode("utf-8"))}

    def prompt(self, entries: list[dict[int, float] | None]) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, decoded_token}}."""
        return [None if e is None else {str(i): {"logprob": max(v, FLOOR), "decoded_token": self._text(i)}
                                        for i, v in e.items()} for e in entries]


def merge(first: dict, second: dict) -> dict:
    """Two completion `logprobs` pieces as one (the echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}
