"""Request state inside the engine, and the outputs handed back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from runner_core.engine.multimodal import MultiModalItem
from runner_core.sampling_params import SamplingParams
from runner_core.spec_decode.metrics import SpecDecodingStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """One request's timing: the one record of it from the engine out (vLLM's RequestMetrics and
    RequestStateStats), read by the session's handles, the load drivers' summaries and the API's /metrics.

    `side` says whose clock the times are on. "engine": the engine's clock (time.perf_counter(), or a
    simulation's virtual clock); each output token is stamped when the step that sampled it processes its
    outputs (one clock read per step), `arrival_time` when the request was handed in (`add_request`, or
    earlier where the caller passes its own record: the session's submit, a load driver's send). "client":
    the client's time.perf_counter() as the response's bytes arrived (network and HTTP framing included;
    a chunk carrying k tokens gives k equal times). Engine- and client-side figures of one run differ by
    that transport, legitimately.

    The figures, defined here only (those of vLLM's serving benchmark): TTFT = first token - arrival;
    E2E = finished - arrival; TPOT = (last token - first token) / (output tokens - 1), so the first token is
    excluded; ITLs = the gaps between successive distinct token times (one per streamed chunk; in process a
    chunk is one token). A request is `ok` when it finished without an error (an abort is an error)."""

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finished_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    side: str = "engine"  # or "client"
    spec_decoding: SpecDecodingStats | None = None  # its drafts and how many were accepted (speculation on)

    def finish(self, now: float, reason: str | None, error: str | None = None) -> None:
        """End the record at `now`; "error" and "abort" are errors (`error` says why, or the reason does)."""
        self.finished_time, self.finish_reason = now, reason
        if error is None and reason in ("error", "abort"):
            error = f"request ended with finish_reason {reason!r}"
        self.error = error

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_time is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:]) if b != a]

    def as_dict(self, num_cached_tokens: int = 0) -> dict:
        """A finished or streaming RequestOutput's `metrics`: TTFT, the decode rate (1 / TPOT, once
        finished) and E2E in seconds, preemptions and prompt tokens found in the prefix cache."""
        tpot = self.tpot if self.finished_time is not None else None
        spec = {} if self.spec_decoding is None else {"spec_decoding": self.spec_decoding.as_dict()}
        return {
            "time_to_first_token_s": self.ttft,
            "tokens_per_s": 1 / tpot if tpot else None,
            "latency_s": self.e2e,
            "num_preemptions": self.num_preemptions,
            "num_cached_prompt_tokens": num_cached_tokens,
            **spec,
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
    # entries of block_table every rank's BlockTable holds (StepBatch.new_blocks sends the rest); 0 again
    # when MemoryManager.free empties the table
    num_sent_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of its full blocks
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0  # of its sampled tokens (raw log-softmax), summed while logprobs are kept
    # the sequences it becomes when its prompt completes (params.num_sequences until it forks, then 1), and
    # its ParentRequest (engine/parallel_sampling.py) when it is one of several
    fork_into: int = 1
    group: object | None = None
    # with params.prompt_logprobs: one entry per prompt token computed so far, None for the first (no context)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    detokenizer: object | None = None
    text: str | None = None  # final text, set when the request finishes
    mm_items: tuple[MultiModalItem, ...] = ()  # its images, by placeholder position
    spec_token_ids: list[int] = field(default_factory=list)  # drafts the next step verifies (engine/spec_decode.py)
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
    def prompt_logprobs_pending(self) -> bool:
        """It asked for prompt logprobs and some are still to compute: its prompt runs through the model
        whole (no prefix-cache hit), as vLLM does, since a cached block's logits are not kept."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

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
        """End the sequence at `now` (the engine's clock); a group's member leaves the request's end (its
        shared RequestMetrics) to its group."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        if self.group is None:
            self.metrics.finished_time = now


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's name): `index` 0..n-1, its tokens and text so far (final once
    `finished`), what is new since the request's previous output (`delta_*`), its logprobs (with
    SamplingParams.logprobs) and the sum of its sampled tokens' logprobs (None when none were computed)."""

    index: int
    text: str
    token_ids: list[int]
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What a request has produced so far. `delta_*` hold what is new since the previous output.

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort" (cancelled) or "error" (the request was refused or failed;
    `error` says why). `outputs`: its completions (CompletionOutput, each with its `index`); the fields
    `text`, `token_ids`, `delta_*`, `finish_reason`, `stop_reason` and `logprobs` are those of `outputs[0]`.
    With SamplingParams.n > 1 read `outputs`: a streamed output holds the completions that advanced in the
    step, the final one all n, by index (with best_of, the n best by cumulative logprob, best first). `text`
    is filled at the end, and during streaming. `logprobs` (with `SamplingParams.logprobs=k`): per output
    token {token id: logprob} of the sampled token and the k most likely ones (vLLM's shape; the log-softmax
    of the model's raw logits, before temperature and top-k/p/min-p).
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
    # per prompt token, {token id: logprob} of it and the top `prompt_logprobs`; None for the first token
    prompt_logprobs: list[dict[int, float] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.text, self.token_ids, self.delta_token_ids, self.delta_text,
                                             self.finished, self.finish_reason, self.stop_reason, self.logprobs)]

    @classmethod
    def of(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], outputs: list[CompletionOutput],
           finished: bool, error: str | None, metrics: dict, prompt_logprobs=None) -> RequestOutput:
        """A request's output from its completions (the top-level fields are the first one's)."""
        first = outputs[0]
        return cls(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, token_ids=first.token_ids,
                   text=first.text, delta_token_ids=first.delta_token_ids, delta_text=first.delta_text,
                   finished=finished, finish_reason="error" if error is not None else first.finish_reason,
                   stop_reason=first.stop_reason, error=error, logprobs=first.logprobs, metrics=metrics,
                   prompt_logprobs=prompt_logprobs, outputs=outputs)

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
