"""A request's prompt as token ids, made in a small thread pool of the API's own: never on the server's event
loop (which streams every other response) nor on the session's engine thread (which steps every model). A
text prompt goes through the model's tokenizer, chat messages through its chat template; a prompt longer than
the model's context is refused here, before the engine sees it."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from runner_core import InvalidRequestError
from workbench.api.errors import bad, request_error


def max_model_len(entry) -> int | None:
    """The model's context limit in effect (the engine's: the config may leave it to the model)."""
    engine = entry.runner.engine if entry.runner is not None else None
    return engine.max_model_len if engine is not None else entry.config.max_model_len


class PromptEncoder:
    """Token ids of completion prompts and chat messages, off the loop and the engine thread; `close()`
    ends its threads."""

    def __init__(self, workers: int | None = None):
        self._pool = ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1),
                                        thread_name_prefix="workbench-api-prompt")

    async def completion(self, entry, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad("prompt", "prompt is empty; give at least one character or one token id")
            try:
                ids = await self._run(entry.runner.tokenizer.encode, prompt)
            except InvalidRequestError as exc:  # a model without a tokenizer whose vocabulary cannot hold bytes
                raise request_error(exc) from exc
        else:
            ids = prompt
        _check_length(entry, len(ids), "prompt", f"prompt has {len(ids)} tokens")
        return list(ids)

    async def chat(self, entry, body, name: str) -> list[int]:
        """The messages of `body` through the chat template of `entry` (served as `name`)."""
        ids = await self._run(_chat_ids, entry, body, name)
        _check_length(entry, len(ids), "messages", f"the messages make a prompt of {len(ids)} tokens")
        return ids

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_length(entry, n: int, param: str, what: str) -> None:
    limit = max_model_len(entry)
    if limit is not None and n >= limit:
        raise bad(param, f"{what} but max_model_len is {limit} (prompt and output together); shorten the prompt "
                         "or raise max_model_len")


def _chat_ids(entry, body, name: str) -> list[int]:
    """The messages through the tokenizer's chat template, as token ids (in the pool)."""
    hf = entry.runner.tokenizer.hf
    if hf is None or not getattr(hf, "chat_template", None):
        raise bad("messages", f"the tokenizer of {name!r} has no chat template, so messages cannot be turned "
                              "into a prompt; use /v1/completions with a prompt, or load a model whose tokenizer "
                              "has a chat_template (tokenizer_config.json)")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template refused these messages (roles, order...)
        raise bad("messages", f"the chat template refused the messages: {type(exc).__name__}: {exc}") from exc
    return list(hf.encode(text, add_special_tokens=False))
