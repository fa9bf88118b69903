"""The response objects of the two generation endpoints, streamed (chunks) and not, in OpenAI's shapes: one
format per request, which holds what its responses add to the text (the echoed prompt, the logprobs). With n > 1
a response has a choice per completion (`index` 0..n-1), and each chunk carries one choice, by its index."""

from __future__ import annotations

from workbench.api.logprobs import TokenLogprobs, merge
from workbench.api.protocol import now


class CompletionFormat:
    """/v1/completions' `text_completion` objects. `logprobs`: the top tokens per position the request asked,
    or None; `echo`: (the prompt's text, its token ids) when the prompt is echoed before the output;
    `tokenizer`: the model's, for the tokens' text."""

    prefix = "cmpl"

    def __init__(self, tokenizer, logprobs: int | None = None, echo: tuple[str, list[int]] | None = None):
        self.tokenizer, self.echo = tokenizer, echo
        self.logprobs = None if logprobs is None else TokenLogprobs(tokenizer, logprobs)

    def start(self, rid, model, handle, index=0):
        """Choice `index`'s first chunk: the echoed prompt (with its logprobs) and the prompt logprobs asked, or
        nothing."""
        if self.echo is None and handle.prompt_logprobs is None:
            return None
        text = self.echo[0] if self.echo is not None else ""
        chunk = self.chunk(rid, model, text, None, self._prompt_logprobs(handle), index)
        self._add_prompt_logprobs(chunk["choices"][0], handle)
        return chunk

    def _add_prompt_logprobs(self, choice: dict, handle) -> None:
        if handle.prompt_logprobs is not None:  # vLLM's extension, by token id
            choice["prompt_logprobs"] = TokenLogprobs(self.tokenizer, 0).prompt(handle.prompt_logprobs)

    def _prompt_logprobs(self, handle):
        if self.echo is None or self.logprobs is None or handle.prompt_logprobs is None:
            return None
        return self.logprobs.completion(self.echo[1], handle.prompt_logprobs)

    def token_logprobs(self, ids, entries):
        return None if self.logprobs is None or entries is None else self.logprobs.completion(ids, entries)

    def chunk(self, rid, model, text, finish_reason, logprobs=None, index=0):
        return {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def final(self, rid, model, handle, use):
        return {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "choices": [self._choice(c, handle) for c in handle.output.outputs], "usage": use}

    def _choice(self, c, handle) -> dict:
        prompt = self._prompt_logprobs(handle)  # first: the echoed prompt's text offsets come first
        logprobs = self.token_logprobs(c.token_ids, c.logprobs)
        text = c.text if self.echo is None else self.echo[0] + c.text
        if prompt is not None and logprobs is not None:
            logprobs = merge(prompt, logprobs)
        choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        self._add_prompt_logprobs(choice, handle)
        return choice


class ChatFormat:
    """/v1/chat/completions' `chat.completion` objects and chunks; `logprobs` as CompletionFormat's."""

    prefix = "chatcmpl"

    def __init__(self, tokenizer, logprobs: int | None = None):
        self.logprobs = None if logprobs is None else TokenLogprobs(tokenizer, logprobs)

    def start(self, rid, model, handle, index=0):
        return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def token_logprobs(self, ids, entries):
        return None if self.logprobs is None or entries is None else self.logprobs.chat(ids, entries)

    def chunk(self, rid, model, text, finish_reason, logprobs=None, index=0):
        return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [{"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}

    def final(self, rid, model, handle, use):
        return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": self.token_logprobs(c.token_ids, c.logprobs),
                             "finish_reason": c.finish_reason} for c in handle.output.outputs],
                "usage": use}
