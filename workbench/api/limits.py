"""`ApiLimits`: what one request, and all of them together, may ask of the API (body size, requests served at
once and waiting, stop strings, chat messages), with defaults that refuse nothing a client of vLLM's server
or of OpenAI's sends in practice; and the checks of a parsed request's fields against them (400s naming the
field, in OpenAI's words)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from runner_core.errors import ConfigError
from workbench.api.errors import bad


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on the API's requests. Over `max_body_bytes` a request is a 413; beyond
    `max_concurrent_requests` generation requests being served, up to `max_queued_requests` more wait
    (unread) for a slot and any further one is a 429 with Retry-After; more stop strings than
    `max_stop_sequences`, a stop string over `max_stop_chars` characters or more chat messages than
    `max_messages` is a 400."""

    max_body_bytes: int = 16 << 20  # a 1M-token context as text or as JSON token ids fits
    max_concurrent_requests: int = 256  # RunnerConfig.max_num_seqs' default (vLLM's): the engine's batch
    max_queued_requests: int = 1024  # vLLM queues without bound; waiting requests hold only their socket
    max_stop_sequences: int = 16  # OpenAI allows 4, vLLM any number: each is searched for at every step
    max_stop_chars: int = 256
    max_messages: int = 2048  # OpenAI's bound on chat messages

    def __post_init__(self):
        for f in fields(self):
            value, least = getattr(self, f.name), self.least(f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"ApiLimits.{f.name} got {value!r}; allowed: an int >= {least}")

    @staticmethod
    def least(field: str) -> int:
        """The smallest value `field` takes (no queue at all is allowed: a 429 once every slot is busy)."""
        return 0 if field == "max_queued_requests" else 1

    @classmethod
    def coerce(cls, limits: ApiLimits | dict | None) -> ApiLimits:
        """An ApiLimits from itself, a dict of its fields (an unknown one named in the error) or None (defaults)."""
        if limits is None or isinstance(limits, ApiLimits):
            return limits or cls()
        unknown = sorted(set(limits) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"ApiLimits has no field {', '.join(map(repr, unknown))}; allowed: "
                              f"{', '.join(f.name for f in fields(cls))}")
        return cls(**limits)

    def check_stop(self, stop: str | list[str] | None) -> None:
        items = [stop] if isinstance(stop, str) else stop or []
        if len(items) > self.max_stop_sequences:
            raise bad("stop", f"Invalid 'stop': array too long. Expected an array with maximum length "
                              f"{self.max_stop_sequences}, but got an array with length {len(items)} instead "
                              "(the server's max_stop_sequences)", code="array_above_max_length")
        longest = max(items, key=lambda s: len(s) if isinstance(s, str) else 0, default="")
        if isinstance(longest, str) and len(longest) > self.max_stop_chars:
            raise bad("stop", f"Invalid 'stop': a stop string of {len(longest)} characters is over the server's "
                              f"max_stop_chars ({self.max_stop_chars}); stop at a shorter string",
                      code="string_above_max_length")

    def check_messages(self, messages: list) -> None:
        if len(messages) > self.max_messages:
            raise bad("messages", f"Invalid 'messages': array too long. Expected an array with maximum length "
                                  f"{self.max_messages}, but got an array with length {len(messages)} instead "
                                  "(the server's max_messages)", code="array_above_max_length")
