"""The API's routes over a Session: /health, /v1/models, /v1/completions, /v1/chat/completions, /metrics.
Generation goes through `session.submit` (the engine thread the dashboards watch); errors are OpenAI's
JSON shape with a 4xx status naming the field."""

from __future__ import annotations

import hmac
import json

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runner_core import InvalidRequestError, SamplingParams
from workbench.api.admission import LimitsMiddleware, Slots
from workbench.api.bridge import Job
from workbench.api.errors import ApiError, bad, request_error
from workbench.api.formats import ChatFormat, CompletionFormat
from workbench.api.limits import ApiLimits
from workbench.api.logprobs import chat_fields, completion_fields
from workbench.api.names import served_names, session_name
from workbench.api.prometheus import ApiMetrics
from workbench.api.prompts import PromptEncoder, max_model_len
from workbench.api.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage


def create_app(session, *, api_key: str | None = None, metrics: ApiMetrics | None = None,
               limits: ApiLimits | dict | None = None) -> FastAPI:
    """The FastAPI app over `session`; with `api_key` every route but /health needs `Authorization: Bearer`;
    `limits` (ApiLimits, or a dict of its fields) bound what requests may ask. `app.state.prompts.close()`
    ends its prompt threads."""
    limits = ApiLimits.coerce(limits)
    app = FastAPI(title="runner-workbench OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics = metrics or ApiMetrics()
    app.state.jobs = jobs = set()
    app.state.limits = limits
    app.state.slots = Slots(limits.max_concurrent_requests, limits.max_queued_requests)
    app.state.prompts = prompts = PromptEncoder()
    app.add_middleware(LimitsMiddleware, limits=limits, slots=app.state.slots)

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
        found = session_name(session, name) if name else session.active
        entry = models.get(found) if found else None
        if entry is None:
            raise ApiError(404, f"the model {name!r} is not loaded; loaded: {', '.join(_ordered(session).values())}",
                           type="not_found_error", param="model", code="model_not_found")
        name = served_names(session).get(entry.name, name)
        if entry.status == "loading":
            raise ApiError(503, f"the model {name!r} is still loading; retry when it is ready",
                           type="service_unavailable")
        return entry

    @app.get("/health")
    async def health():
        served = served_names(session)
        ready = [served[n] for n, e in session.models.items() if e.status != "loading" and n in served]
        if not ready:
            return ApiError(503, "no model is loaded", type="service_unavailable").response()
        return {"status": "ok", "models": ready}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def list_models():
        models = session.models
        data = [{"id": served, "object": "model", "created": now(), "owned_by": "runner-workbench",
                 "root": served, "max_model_len": max_model_len(models[name])}
                for name, served in _ordered(session).items() if name in models]
        return {"object": "list", "data": data}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def prometheus_metrics():
        return Response(metrics.render(session), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        if body.suffix:
            raise bad("suffix", "suffix (insertion) is not supported; send the prompt alone")
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise bad("best_of", f"best_of={body.best_of} > n={body.n} cannot stream (the n best are known only at "
                                 "the end); send stream=false, or best_of equal to n")
        prompt = _one_prompt(body.prompt)
        limits.check_stop(body.stop)
        entry = entry_for(body.model)
        params = _sampling(body, body.max_tokens).replace(**completion_fields(body))
        ids = await prompts.completion(entry, prompt)
        tokenizer = entry.runner.tokenizer
        echo = None
        if body.echo:  # the prompt's text as given, or its token ids' text
            echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False), ids)
        return await _serve(request, body, entry, ids, params, CompletionFormat(tokenizer, params.logprobs, echo))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        limits.check_stop(body.stop)
        limits.check_messages(body.messages)
        entry = entry_for(body.model)
        ids = await prompts.chat(entry, body, served_names(session).get(entry.name, entry.name))
        limit = body.max_completion_tokens or body.max_tokens
        if limit is None:
            limit = max(1, max_model_len(entry) - len(ids))  # the rest of the context, as OpenAI does
        params = _sampling(body, limit).replace(**chat_fields(body))
        return await _serve(request, body, entry, ids, params, ChatFormat(entry.runner.tokenizer, params.logprobs))

    async def _serve(request, body, entry, ids, params, fmt):
        model = served_names(session).get(entry.name, entry.name)
        try:
            handle = session.submit(ids, model=entry.name, sampling_params=params)
        except Exception as exc:  # the model went away, or the session closed
            raise request_error(exc) from exc
        job = Job(handle, metrics, len(ids), stream=body.stream, model=model, n=params.n)
        jobs.add(job)
        try:
            first = await job.next(request)
        except BaseException:
            job.close()
            jobs.discard(job)
            raise
        if job.finished and handle.exception is not None:
            jobs.discard(job)
            return request_error(handle.exception).response()
        if body.stream:
            return StreamingResponse(_events(job, first, body, model, fmt), media_type="text/event-stream")
        try:
            while not job.finished:
                await job.next(request)
        finally:
            job.close()
            jobs.discard(job)
        if handle.exception is not None:
            return request_error(handle.exception).response()
        return fmt.final(new_id(fmt.prefix), model, handle,
                         usage(job.usage_prompt_tokens(), sum(len(c.token_ids) for c in handle.output.outputs),
                               handle.spec_decoding))

    async def _events(job: Job, first: str, body, model: str, fmt):
        """The stream's chunks: each choice's text as it comes (a chunk per choice, by index), its finish reason
        once it ended (with n=1, once the request did)."""
        rid, texts, ended = new_id(fmt.prefix), [first, *map(job.new_text, range(1, job.n))], [False] * job.n
        try:
            for i in range(job.n):
                yield from_chunk(fmt.start(rid, model, job.handle, i))
            while True:
                for i, text in enumerate(texts):
                    reason = job.reasons[i] or (job.handle.finish_reason if job.finished else None)
                    if ended[i] or not (text or reason):
                        continue
                    ended[i] = reason is not None
                    ids, logprobs = job.new_tokens(i)
                    chunk = fmt.chunk(rid, model, text, None if reason == "error" else reason,
                                      fmt.token_logprobs(ids, logprobs), i)
                    if body.continuous_usage:
                        chunk["usage"] = usage(job.usage_prompt_tokens(), job.sent_tokens)
                    if text or reason not in (None, "error") or ids:
                        yield from_chunk(chunk)
                if job.finished:
                    break
                texts = [await job.next(), *map(job.new_text, range(1, job.n))]
            if job.handle.exception is not None:
                err = request_error(job.handle.exception)
                yield from_chunk(error_body(err.message, type=err.type, param=err.param, code=err.code))
            elif body.include_usage:
                use = usage(job.usage_prompt_tokens(), job.handle.num_tokens, job.handle.spec_decoding)
                yield from_chunk({**fmt.chunk(rid, model, "", None), "choices": [], "usage": use})
            yield "data: [DONE]\n\n"
        finally:  # the client left (the task is cancelled) or the stream ended
            job.close()
            jobs.discard(job)

    return app


def from_chunk(obj: dict | None) -> str:
    return "" if obj is None else f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _ordered(session) -> dict[str, str]:
    """The loaded models' names in the session -> their served names, the active one first."""
    served = served_names(session)
    active = session.active
    return {n: served[n] for n in ([active] if active in served else []) + [n for n in served if n != active]}


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
        return SamplingParams(max_tokens=max_tokens, structured_outputs=body.structured_outputs_params(),
                              **body.sampling_fields())
    except InvalidRequestError as exc:
        raise request_error(exc) from exc


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
