"""Workloads for load runs: an arrival process x prompt and output lengths (or a dataset file) x
sampling settings, seeded, turned into the list of requests a driver sends.

Synthetic prompts are random token ids in [3, vocab_size) (the benchmarks' convention: ids below 3
are the usual pad/bos/eos specials), so the same requests go in process and over HTTP. The first
request of a Poisson or gamma process is due at t=0 and each gap is drawn after it (vLLM's
`--request-rate` / `--burstiness`: gamma shape = burstiness, scale = 1 / (rate x burstiness)).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from runner_core.sampling_params import SamplingParams

ARRIVAL_KINDS = ("burst", "poisson", "gamma", "concurrency")
MIN_TOKEN_ID = 3


def _positive_int(value, name: str) -> bool:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return True


@dataclass(frozen=True)
class Arrivals:
    """When requests are due: all at once ("burst"), a Poisson or gamma process at `rate` requests/s,
    or "concurrency" (all due at once, the driver keeps `concurrency` in flight). `concurrency` set on
    a Poisson or gamma process caps the requests in flight too."""

    kind: str
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"Arrivals.kind {self.kind!r} is unknown; use one of {', '.join(ARRIVAL_KINDS)}")
        timed = self.kind in ("poisson", "gamma")
        if timed and (not isinstance(self.rate, (int, float)) or isinstance(self.rate, bool)
                      or not 0 < self.rate < math.inf):
            raise ValueError(f"Arrivals {self.kind!r} needs rate = requests/s > 0, got {self.rate!r}")
        if not timed and self.rate is not None:
            raise ValueError(f"Arrivals {self.kind!r} takes no rate (got {self.rate!r}); use 'poisson' or 'gamma'")
        if not isinstance(self.burstiness, (int, float)) or not 0 < self.burstiness < math.inf:
            raise ValueError(f"Arrivals.burstiness must be > 0 (1 = Poisson, < 1 burstier), got {self.burstiness!r}")
        if self.kind == "concurrency" and self.concurrency is None:
            raise ValueError("Arrivals 'concurrency' needs concurrency = the requests kept in flight (an int >= 1)")
        if self.concurrency is not None:
            _positive_int(self.concurrency, "Arrivals.concurrency")
        if self.kind == "burst" and self.concurrency is not None:
            raise ValueError("a burst with a concurrency cap is Arrivals.fixed_concurrency(n)")

    @classmethod
    def burst(cls) -> Arrivals:
        return cls("burst")

    @classmethod
    def poisson(cls, rate: float, concurrency: int | None = None) -> Arrivals:
        return cls("poisson", rate=rate, concurrency=concurrency)

    @classmethod
    def gamma(cls, rate: float, burstiness: float, concurrency: int | None = None) -> Arrivals:
        return cls("gamma", rate=rate, burstiness=burstiness, concurrency=concurrency)

    @classmethod
    def fixed_concurrency(cls, n: int) -> Arrivals:
        return cls("concurrency", concurrency=n)

    def offsets(self, n: int, rng: random.Random) -> list[float]:
        """Due times (s from the run's start) of `n` requests, non-decreasing, the first at 0."""
        if self.kind in ("burst", "concurrency"):
            return [0.0] * n
        shape = 1.0 if self.kind == "poisson" else self.burstiness
        scale = 1.0 / (self.rate * shape)
        out, t = [], 0.0
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(shape, scale)
        return out

    @property
    def label(self) -> str:
        if self.kind == "burst":
            return "burst"
        if self.kind == "concurrency":
            return f"concurrency {self.concurrency}"
        text = f"poisson {self.rate:g}/s" if self.kind == "poisson" else \
            f"gamma {self.rate:g}/s burstiness {self.burstiness:g}"
        return text if self.concurrency is None else f"{text} max {self.concurrency}"


@dataclass(frozen=True)
class Lengths:
    """A length distribution in tokens: "fixed" (low == high) or "uniform" over [low, high] inclusive."""

    kind: str
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform"):
            raise ValueError(f"Lengths.kind {self.kind!r} is unknown; use 'fixed' or 'uniform'")
        _positive_int(self.low, "Lengths.low")
        _positive_int(self.high, "Lengths.high")
        if self.low > self.high or (self.kind == "fixed" and self.low != self.high):
            raise ValueError(f"Lengths {self.kind} got low={self.low} high={self.high}; need low <= high "
                             "(and low == high for 'fixed')")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        return cls("fixed", n, n)

    @classmethod
    def uniform(cls, lo: int, hi: int) -> Lengths:
        return cls("uniform", lo, hi)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.kind == "fixed" else rng.randint(self.low, self.high)

    @property
    def label(self) -> str:
        return str(self.low) if self.kind == "fixed" else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: when it is due, its prompt (text or token ids), its exact output length and its
    SamplingParams fields."""

    index: int
    arrival_s: float
    prompt: str | list[int]
    max_tokens: int
    sampling: dict = field(default_factory=dict)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling)


@dataclass(frozen=True)
class Workload:
    """What a load run sends; `requests()` is deterministic for a seed. With `dataset` set, prompts
    are the file's first `num_requests` entries (see `load_dataset`); an entry without its own output
    length samples `output_len`, except a ShareGPT reply, which counts its tokens when a tokenizer is
    given. Arrivals draw from their own stream of the seed, so changing them keeps the prompts."""

    num_requests: int = 32
    arrivals: Arrivals = Arrivals.burst()
    prompt_len: Lengths = Lengths.uniform(16, 128)
    output_len: Lengths = Lengths.uniform(16, 64)
    dataset: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int(self.num_requests, "Workload.num_requests")
        for name, kind in (("arrivals", Arrivals), ("prompt_len", Lengths), ("output_len", Lengths)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"Workload.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.dataset is not None and not isinstance(self.dataset, (str, Path)):
            raise ValueError(f"Workload.dataset must be a file path or None, got {self.dataset!r}")
        if isinstance(self.dataset, Path):
            object.__setattr__(self, "dataset", str(self.dataset))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Workload.seed must be an int >= 0, got {self.seed!r}")
        SamplingParams(max_tokens=1, temperature=self.temperature, top_p=self.top_p, ignore_eos=self.ignore_eos)

    def requests(self, vocab_size: int, tokenizer=None) -> list[WorkloadRequest]:
        """The requests in due order. `vocab_size` bounds synthetic token ids; `tokenizer` (runner_core's
        or a Hugging Face one) counts a ShareGPT reply's tokens."""
        rng = random.Random(self.seed)
        due = self.arrivals.offsets(self.num_requests, random.Random(f"arrivals-{self.seed}"))
        if self.dataset is None:
            if not isinstance(vocab_size, int) or vocab_size <= MIN_TOKEN_ID:
                raise ValueError(f"vocab_size must be an int > {MIN_TOKEN_ID} for synthetic prompts, "
                                 f"got {vocab_size!r}")
            items = []
            for _ in range(self.num_requests):
                n_prompt, n_out = self.prompt_len.sample(rng), self.output_len.sample(rng)
                items.append(([rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n_prompt)], n_out))
        else:
            entries = load_dataset(self.dataset)
            if len(entries) < self.num_requests:
                raise ValueError(f"dataset {self.dataset} has {len(entries)} usable entries, fewer than "
                                 f"num_requests={self.num_requests}; lower num_requests or add entries")
            items = [(e.prompt, e.output_len(self.output_len, rng, tokenizer))
                     for e in entries[:self.num_requests]]
        return [WorkloadRequest(i, t, prompt, n_out, {"max_tokens": n_out, "temperature": self.temperature,
                                                      "top_p": self.top_p, "seed": self.seed + i,
                                                      "ignore_eos": self.ignore_eos})
                for i, (t, (prompt, n_out)) in enumerate(zip(due, items))]

    def replace(self, **changes) -> Workload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Workload.from_dict got unknown keys {unknown}; known: {sorted(known)}")
        d = dict(d)
        for name, kind in (("arrivals", Arrivals), ("prompt_len", Lengths), ("output_len", Lengths)):
            if isinstance(d.get(name), dict):
                try:
                    d[name] = kind(**d[name])
                except TypeError as e:
                    raise ValueError(f"Workload.from_dict: bad {name} {d[name]!r} ({e})") from None
        return cls(**d)

    @property
    def label(self) -> str:
        source = (f"{Path(self.dataset).name}" if self.dataset is not None
                  else f"prompt {self.prompt_len.label}")
        return f"{self.num_requests} req, {self.arrivals.label}, {source}, out {self.output_len.label}"


@dataclass(frozen=True)
class DatasetEntry:
    """One prompt of a dataset file and its output length: given (`max_tokens`), or the text of a
    reply (`reply`) whose tokens are counted, or neither (sampled)."""

    prompt: str | list[int]
    max_tokens: int | None = None
    reply: str | None = None

    def output_len(self, default: Lengths, rng: random.Random, tokenizer) -> int:
        if self.max_tokens is not None:
            return self.max_tokens
        if self.reply is not None and tokenizer is not None:
            return max(1, count_tokens(tokenizer, self.reply))
        return default.sample(rng)


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` without special tokens, by runner_core's Tokenizer or a Hugging Face one."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if hf is None:  # runner_core's byte-level fallback: one token per UTF-8 byte
        return len(text.encode("utf-8"))
    return len(hf.encode(text, add_special_tokens=False))


def tokenizer_vocab(tokenizer) -> int:
    """The number of token ids of runner_core's Tokenizer or a Hugging Face one."""
    return tokenizer.vocab_size if hasattr(tokenizer, "hf") else len(tokenizer)


def load_dataset(path) -> list[DatasetEntry]:
    """Read a JSONL file (one {"prompt": str or token ids, "output_len" or "max_tokens": int} per
    line; the length is optional) or a ShareGPT JSON file (a list of {"conversations": [{"from":
    "human"|"gpt", "value": str}, ...]}: the prompt is the first human turn, the reply the gpt turn
    after it; conversations without both are skipped, as vLLM's benchmark does). A malformed file
    raises ValueError naming the file, the line or entry and the field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"dataset {path}: cannot read it ({e.strerror or e})") from None
    if text.lstrip().startswith("["):
        return _sharegpt(path, text)
    return [_jsonl_entry(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _jsonl_entry(path: Path, n: int, line: str) -> DatasetEntry:
    where = f"dataset {path} line {n}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}); each line must be one JSON object") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with a 'prompt' field, got {type(row).__name__}")
    prompt = row.get("prompt")
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
    if not ((isinstance(prompt, str) and prompt) or ids):
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string or a list of token ids, "
                         f"got {prompt!r:.60}")
    length = row.get("output_len", row.get("max_tokens"))
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        name = "output_len" if "output_len" in row else "max_tokens"
        raise ValueError(f"{where}: field '{name}' must be an int >= 1, got {length!r}")
    return DatasetEntry(prompt, length)


def _sharegpt(path: Path, text: str) -> list[DatasetEntry]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset {path}: not valid JSON at line {e.lineno} ({e.msg})") from None
    out = []
    for i, row in enumerate(rows):
        turns = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"dataset {path} entry {i}: field 'conversations' must be a list of "
                             "{'from': 'human'|'gpt', 'value': str} turns (ShareGPT format)")
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) \
                    or not isinstance(turn.get("value"), str):
                raise ValueError(f"dataset {path} entry {i} turn {j}: needs string fields 'from' and 'value'")
        human = next((j for j, t in enumerate(turns) if t["from"] == "human" and t["value"]), None)
        if human is not None and human + 1 < len(turns) and turns[human + 1]["from"] == "gpt":
            out.append(DatasetEntry(turns[human]["value"], reply=turns[human + 1]["value"]))
    return out
