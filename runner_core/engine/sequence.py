"""Request state inside the engine, and the outputs handed back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from runner_core.engine.multimodal import MultiModalItem
from runner_core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tokens_per_s(self, num_tokens: int) -> float | None:
        """Decode rate after the first token (the first token's time is the TTFT)."""
        if self.finished_time is None or self.first_token_time is None or num_tokens < 2:
            return None
        span = self.finished_time - self.first_token_time
        return (num_tokens - 1) / span if span > 0 else None

    def as_dict(self, num_tokens: int, num_cached_tokens: int = 0) -> dict:
        end = self.finished_time
        return {
            "time_to_first_token_s": self.time_to_first_token,
            "tokens_per_s": self.tokens_per_s(num_tokens),
            "latency_s": None if end is None else end - self.arrival_time,
            "num_preemptions": self.num_preemptions,
            "num_cached_prompt_tokens": num_cached_tokens,
        }


@dataclass(slots=True)
class Sequence:
    """One request: its tokens (prompt then output), progress through the model and KV blocks."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of its full blocks
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    detokenizer: object | None = None
    text: str | None = None  # final text, set when the request finishes
    mm_items: tuple[MultiModalItem, ...] = ()  # its images, by placeholder position
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_key(self, index: int, block_size: int) -> tuple:
        """What identifies full block `index` for the prefix cache: its token ids, and for each image
        it holds tokens of, the image's hash and where the block starts in it."""
        start = index * block_size
        tokens = tuple(self.token_ids[start:start + block_size])
        images = tuple((m.hash, start - m.offset) for m in self.mm_items if m.overlap(start, start + block_size))
        return (tokens, images) if images else tokens

    def finish(self, reason: str, now: float, stop_reason: int | str | None = None, error: str | None = None) -> None:
        """End the request at `now` (the engine's clock)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        self.metrics.finished_time = now


@dataclass
class RequestOutput:
    """What a request has produced so far. `delta_*` hold what is new since the previous output.

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort" (cancelled) or "error" (the request was refused or failed;
    `error` says why). `text` is filled at the end, and during streaming.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None
    logprobs: list[dict[int, float]] | None
    metrics: dict

    @classmethod
    def failed(cls, request_id: str, prompt, error: str) -> RequestOutput:
        """A request refused before it ran (or lost before it produced anything)."""
        return cls(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=[],
                   token_ids=[], text="", delta_token_ids=[], delta_text="", finished=True, finish_reason="error",
                   stop_reason=None, error=error, logprobs=None, metrics={})

    @classmethod
    def aborted(cls, request_id: str, prompt, token_ids: list[int], text: str) -> RequestOutput:
        """A request cancelled after producing `token_ids` / `text` (it may have produced nothing)."""
        return cls(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=[],
                   token_ids=list(token_ids), text=text, delta_token_ids=[], delta_text="", finished=True,
                   finish_reason="abort", stop_reason=None, error=None, logprobs=None, metrics={})

    def __str__(self) -> str:
        return self.text
