"""The API's errors: `ApiError` (an HTTP status with OpenAI's {"error": {message, type, param, code}} body),
`bad` (a 400 naming a field) and `request_error` (the engine's or the session's refusal as an ApiError)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from runner_core import InvalidRequestError
from workbench.api.protocol import error_body
from workbench.runtime.handles import GenerationError, SessionError


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {...}} with `status` (and `headers`, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, type=self.type, param=self.param, code=self.code),
                            status_code=self.status, headers=self.headers)


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def request_error(exc: BaseException) -> ApiError:
    """The engine's refusal of a request (or the session's) as an API error."""
    message = str(exc)
    if isinstance(exc, InvalidRequestError):
        m = re.match(r"SamplingParams\.(\w+)|(response_format|structured_outputs|guided_\w+):", message)
        param = (m.group(1) or m.group(2)) if m else "prompt" if re.match(r"(prompt|token id)", message) else None
        return bad(param, message)
    if isinstance(exc, SessionError):  # NoModelError included: the model went away
        return ApiError(503, message, type="service_unavailable")
    return ApiError(500, message if isinstance(exc, GenerationError) else f"{type(exc).__name__}: {message}",
                    type="server_error")
