"""An OpenAI-compatible HTTP API over a workbench Session (`Session.serve_api`, `python -m workbench api`):
/v1/models, /v1/completions, /v1/chat/completions, /health and Prometheus /metrics."""

from workbench.api.limits import ApiLimits
from workbench.api.server import ApiServer, check_exposure, serve_api

__all__ = ["ApiLimits", "ApiServer", "check_exposure", "serve_api"]
