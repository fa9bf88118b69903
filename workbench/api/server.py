"""`serve_api(session, port=, host=, api_key=, limits=)`: the OpenAI-compatible API served by uvicorn from a
daemon thread, so the notebook (or the dashboard's loop) stays free; loopback by default, any other host only
with an API key; `limits` (ApiLimits) bound body size, requests at once and waiting, stop strings, messages.
FastAPI on uvicorn because it is what vLLM's own server uses: pydantic request models give field-named
validation errors, and streamed responses are plain async generators."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

import uvicorn

from workbench.api.app import create_app
from workbench.api.limits import ApiLimits
from workbench.runtime.handles import SessionError

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class ApiServer:
    """A running API: `url` (http://host:port), `port`, `limits`, `stop()` (idempotent; ends the streams it
    serves)."""

    def __init__(self, session, *, port: int = 0, host: str = "127.0.0.1", api_key: str | None = None,
                 limits: ApiLimits | dict | None = None, start_timeout: float = 30.0):
        check_exposure(host, api_key)
        self.host, self.session = host, session
        self.limits = ApiLimits.coerce(limits)
        self.app = create_app(session, api_key=api_key, limits=self.limits)
        self._socket = _bind(host, port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", loop="auto", lifespan="off",
                                timeout_graceful_shutdown=3)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True,
                                        name=f"workbench-api-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise SessionError(f"the API server on {self.url} did not start (see the log above)")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the requests it serves, stop the server and join its thread."""
        for job in list(self.app.state.jobs):
            job.close()
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._socket.close()
        self.app.state.prompts.close()

    def __repr__(self) -> str:
        return f"<ApiServer {self.url} {'running' if self.running else 'stopped'}>"


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse a host off loopback without an API key, saying how to pass one."""
    if host not in LOOPBACK and not api_key:
        raise SessionError(f"serving the API on {host} lets anyone who can reach this machine run the loaded "
                           "models; pass api_key=... (clients send it as Authorization: Bearer <key>; on the command "
                           "line --api-key KEY or WORKBENCH_API_KEY), or bind 127.0.0.1 and reach it through an SSH "
                           "tunnel")


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name (localhost)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SessionError(f"cannot serve the API on {host}:{port}: {exc}; pick another port (0: a free one)") from exc
    return sock


def serve_api(session, port: int = 0, *, host: str = "127.0.0.1", api_key: str | None = None,
              limits: ApiLimits | dict | None = None) -> ApiServer:
    """Start the API over `session` in a background thread; returns the running ApiServer. `limits`: an
    ApiLimits or a dict of its fields (None: the defaults)."""
    return ApiServer(session, port=port, host=host, api_key=api_key, limits=limits)
