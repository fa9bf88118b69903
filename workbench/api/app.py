"""The API's routes over a Session: /health, /v1/models, /v1/completions, /v1/chat/completions, /metrics.
Generation goes through `session.submit` (the engine thread the dashboards watch); errors are OpenAI's
JSON shape with a 4xx status naming the field."""

from __future__ import annotations

import hmac
import json
import re

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runner_core import InvalidRequestError, SamplingParams
from workbench.api.bridge import Job
from workbench.api.prometheus import ApiMetrics
from workbench.api.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage
from workbench.handles import GenerationError, SessionError


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, type=self.type, param=self.param, code=self.code),
                            status_code=self.status)


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _request_error(exc: BaseException) -> ApiError:
    """The engine's refusal of a request (or the session's) as an API error."""
    message = str(exc)
    if isinstance(exc, InvalidRequestError):
        m = re.match(r"SamplingParams\.(\w+)", message)
        param = m.group(1) if m else "prompt" if re.match(r"(prompt|token id)", message) else None
        return bad(param, message)
    if isinstance(exc, SessionError):  # NoModelError included: the model went away
        return ApiError(503, message, type="service_unavailable")
    return ApiError(500, message if isinstance(exc, GenerationError) else f"{type(exc).__name__}: {message}",
                    type="server_error")


def create_app(session, *, api_key: str | None = None, metrics: ApiMetrics | None = None) -> FastAPI:
    """The FastAPI app over `session`; with `api_key` every route but /health needs `Authorization: Bearer`."""
    app = FastAPI(title="runner-workbench OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics = metrics or ApiMetrics()
    app.state.jobs = jobs = set()

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return ApiError(404, f"no route {request.method} {request.url.path}; the API serves /v1/models, "
                                 "/v1/completions, /v1/chat/completions, /health and /metrics",
                            type="not_found_error").response()
        return ApiError(exc.status_code, str(exc.detail), type="invalid_request_error").response()

    def entry_for(name: str | None):
        models = session.models
        if not models:
            raise ApiError(503, "no model is loaded: load one in the session (session.load_model(...)) or start the "
                                "server with --model", type="service_unavailable")
        name = name or session.active
        entry = models.get(name)
        if entry is None:
            raise ApiError(404, f"the model {name!r} is not loaded; loaded: {', '.join(_ordered(session))}",
                           type="not_found_error", param="model", code="model_not_found")
        if entry.status == "loading":
            raise ApiError(503, f"the model {name!r} is still loading; retry when it is ready",
                           type="service_unavailable")
        return entry

    @app.get("/health")
    async def health():
        ready = [n for n, e in session.models.items() if e.status != "loading"]
        if not ready:
            return ApiError(503, "no model is loaded", type="service_unavailable").response()
        return {"status": "ok", "models": ready}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def list_models():
        data = [{"id": name, "object": "model", "created": now(), "owned_by": "runner-workbench",
                 "root": str(session.models[name].config.model),
                 "max_model_len": _max_model_len(session.models[name])} for name in _ordered(session)]
        return {"object": "list", "data": data}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def prometheus_metrics():
        return Response(metrics.render(session), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        _refuse_unsupported(body)
        if body.echo:
            raise bad("echo", "echo is not supported; prepend the prompt to the returned text yourself")
        if body.suffix:
            raise bad("suffix", "suffix (insertion) is not supported; send the prompt alone")
        if body.best_of not in (None, 1):
            raise bad("best_of", "only best_of=1 is supported; send several requests and compare them")
        prompt = _one_prompt(body.prompt)
        entry = entry_for(body.model)
        params = _sampling(body, body.max_tokens)
        known = len(prompt) if isinstance(prompt, list) else None
        if known is None and body.stream and body.continuous_usage:  # every chunk's usage names the prompt's size
            known = len(entry.runner.tokenizer.encode(prompt))
        return await _serve(request, body, entry.name, prompt, params, known, _CompletionFormat())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _refuse_unsupported(body)
        if body.top_logprobs:
            raise bad("top_logprobs", "logprobs are not supported by this server")
        entry = entry_for(body.model)
        ids = _chat_prompt(entry, body)
        limit = body.max_completion_tokens or body.max_tokens
        if limit is None:
            limit = max(1, _max_model_len(entry) - len(ids))  # the rest of the context, as OpenAI does
        params = _sampling(body, limit)
        return await _serve(request, body, entry.name, ids, params, len(ids), _ChatFormat())

    async def _serve(request, body, model, prompt, params, prompt_tokens, fmt):
        try:
            handle = session.submit(prompt, model=model, sampling_params=params)
        except Exception as exc:  # the model went away, or the session closed
            raise _request_error(exc) from exc
        job = Job(handle, metrics, prompt_tokens, stream=body.stream)
        jobs.add(job)
        try:
            first = await job.next(request)
        except BaseException:
            job.close()
            jobs.discard(job)
            raise
        if job.finished and handle.exception is not None:
            jobs.discard(job)
            return _request_error(handle.exception).response()
        if body.stream:
            return StreamingResponse(_events(job, first, body, model, fmt), media_type="text/event-stream")
        try:
            while not job.finished:
                await job.next(request)
        finally:
            job.close()
            jobs.discard(job)
        if handle.exception is not None:
            return _request_error(handle.exception).response()
        out = handle.output
        return fmt.final(new_id(fmt.prefix), model, out.text, out.finish_reason,
                         usage(job.usage_prompt_tokens(), len(out.token_ids)))

    async def _events(job: Job, first: str, body, model: str, fmt):
        rid, text = new_id(fmt.prefix), first
        try:
            yield from_chunk(fmt.start(rid, model))
            while True:
                if text or job.finished:
                    reason = job.handle.finish_reason if job.finished else None
                    chunk = fmt.chunk(rid, model, text, None if reason == "error" else reason)
                    n = job.new_tokens()
                    if body.continuous_usage:
                        chunk["usage"] = usage(job.usage_prompt_tokens(), job.sent_tokens)
                    if text or reason not in (None, "error") or n:
                        yield from_chunk(chunk)
                if job.finished:
                    break
                text = await job.next()
            if job.handle.exception is not None:
                err = _request_error(job.handle.exception)
                yield from_chunk(error_body(err.message, type=err.type, param=err.param, code=err.code))
            elif body.include_usage:
                yield from_chunk({**fmt.chunk(rid, model, "", None), "choices": [],
                                  "usage": usage(job.usage_prompt_tokens(), len(job.handle.token_ids))})
            yield "data: [DONE]\n\n"
        finally:  # the client left (the task is cancelled) or the stream ended
            job.close()
            jobs.discard(job)

    return app


def from_chunk(obj: dict | None) -> str:
    return "" if obj is None else f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _ordered(session) -> list[str]:
    """The loaded models' names, the active one first."""
    names = list(session.models)
    active = session.active
    return ([active] if active in names else []) + [n for n in names if n != active]


def _max_model_len(entry) -> int | None:
    """The model's context limit in effect (the engine's: the config may leave it to the model)."""
    engine = entry.runner.engine if entry.runner is not None else None
    return engine.max_model_len if engine is not None else entry.config.max_model_len


def _refuse_unsupported(body) -> None:
    if body.n != 1:
        raise bad("n", f"only n=1 is supported (got n={body.n}); send {body.n} requests (with different seeds)")
    if body.logprobs not in (None, False, 0):
        raise bad("logprobs", "logprobs are not supported by this server; leave logprobs unset")


def _one_prompt(prompt):
    """The one prompt of a /v1/completions request: text or token ids (or a list holding one of those)."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise bad("prompt", "prompt is empty; give a string or a list of token ids")
    if isinstance(prompt[0], int):
        return list(prompt)
    if len(prompt) != 1:
        raise bad("prompt", f"one prompt per request is supported (got {len(prompt)}); send each prompt as its own "
                            "request (they run batched together)")
    return prompt[0]


def _sampling(body, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **body.sampling_fields())
    except InvalidRequestError as exc:
        raise _request_error(exc) from exc


def _chat_prompt(entry, body: ChatCompletionRequest) -> list[int]:
    """The messages through the tokenizer's chat template, as token ids."""
    tokenizer = entry.runner.tokenizer
    hf = tokenizer.hf
    if hf is None or not getattr(hf, "chat_template", None):
        raise bad("messages", f"the tokenizer of {entry.name!r} has no chat template, so messages cannot be turned "
                              "into a prompt; use /v1/completions with a prompt, or load a model whose tokenizer "
                              "has a chat_template (tokenizer_config.json)")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template refused these messages (roles, order...)
        raise bad("messages", f"the chat template refused the messages: {type(exc).__name__}: {exc}") from exc
    return list(hf.encode(text, add_special_tokens=False))


def _validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as a 400 naming the first bad field."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return bad(None, f"the body is not valid JSON: {err.get('msg')} (at character {loc[0] if loc else '?'})")
    field = loc[0] if loc else None
    where = ".".join(loc) or "the body"
    if err.get("type") == "missing":
        return bad(field, f"{where} is required")
    return bad(field, f"{where}: {err.get('msg')} (got {err.get('input')!r})")


class _CompletionFormat:
    prefix = "cmpl"

    def start(self, rid, model):
        return None

    def chunk(self, rid, model, text, finish_reason):
        return {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def final(self, rid, model, text, finish_reason, use):
        return {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                "usage": use}


class _ChatFormat:
    prefix = "chatcmpl"

    def start(self, rid, model):
        return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, rid, model, text, finish_reason):
        return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [{"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                             "finish_reason": finish_reason}]}

    def final(self, rid, model, text, finish_reason, use):
        return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish_reason}],
                "usage": use}
