"""What a sweep tries: the four stages' candidate settings (`SweepSpace`), the default proposed from
the KV capacity before any run (`propose_space`), how a stage's knobs expand into points, and the values of
the speculative decoding knob (`speculation_values`: off, then n-gram speculation at each k)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from runner_core.spec_decode.config import SpeculativeConfig
from runner_core.tuning.workload import Arrivals, Workload

GRID_LIMIT = 8  # a stage whose knobs' value product is at most this runs as a grid, else one knob at a time
MAX_CONCURRENCY_POINTS = 6


@dataclass
class SweepSpace:
    """The staged search: `layout` (reload-level settings, one dict per layout, e.g.
    {"tensor_parallel_size": 2}), `concurrency` (requests kept in flight; None: proposed from the KV
    capacity), `scheduler` (knob -> values: max_num_seqs, max_num_batched_tokens, block_size,
    kv_cache_memory, speculative_config (`speculation_values`), ...) and `engine` (compile, dtype,
    quantization). Each stage keeps the best point and the next builds on it."""

    layout: list[dict] = field(default_factory=lambda: [{}])
    concurrency: list[int] | None = None
    scheduler: dict[str, list] = field(default_factory=dict)
    engine: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, list) or not self.layout or not all(isinstance(d, dict) for d in self.layout):
            raise ValueError(f"SweepSpace.layout must be a non-empty list of dicts (use [{{}}] for the loaded "
                             f"layout), got {self.layout!r}")
        if self.concurrency is not None and (
                not isinstance(self.concurrency, list) or not self.concurrency
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in self.concurrency)):
            raise ValueError(f"SweepSpace.concurrency must be None (proposed) or a non-empty list of ints >= 1, "
                             f"got {self.concurrency!r}")
        for name in ("scheduler", "engine"):
            knobs = getattr(self, name)
            if not isinstance(knobs, dict) or not all(isinstance(v, list) and v for v in knobs.values()):
                raise ValueError(f"SweepSpace.{name} must map each knob to a non-empty list of values, "
                                 f"got {knobs!r}")
        if "concurrency" in self.scheduler or "concurrency" in self.engine:
            raise ValueError("concurrency is its own stage: pass SweepSpace(concurrency=[...])")

    def fields(self) -> list[str]:
        """Every backend setting the space touches (concurrency is the workload's, not the backend's)."""
        names = [k for layout in self.layout for k in layout] + list(self.scheduler) + list(self.engine)
        return list(dict.fromkeys(names))

    def describe(self) -> dict[str, str]:
        """How each stage runs: its points, and for knob stages whether as a grid or one knob at a time."""
        out = {"layout": f"{len(self.layout)} layouts" if len(self.layout) > 1 else "one layout (not measured)",
               "concurrency": "proposed from the KV capacity" if self.concurrency is None
               else f"{len(self.concurrency)} value(s)"}
        for name in ("scheduler", "engine"):
            knobs = getattr(self, name)
            out[name] = "none" if not knobs else (
                f"grid of {_product(knobs)} points" if is_grid(knobs)
                else f"one knob at a time ({sum(len(v) for v in knobs.values())} points)")
        return out


def _product(knobs: dict[str, list]) -> int:
    return math.prod(len(v) for v in knobs.values())


def is_grid(knobs: dict[str, list]) -> bool:
    return bool(knobs) and _product(knobs) <= GRID_LIMIT


def knob_groups(knobs: dict[str, list]) -> list[list[dict]]:
    """A knob stage's candidates as groups: one group holding the whole grid when the product of the
    value counts is at most GRID_LIMIT, else one group per knob (each group is measured on top of the
    best so far, which the group's best then replaces)."""
    if not knobs:
        return []
    if is_grid(knobs):
        names = list(knobs)
        return [[dict(zip(names, combo)) for combo in itertools.product(*knobs.values())]]
    return [[{name: value} for value in values] for name, values in knobs.items()]


def with_concurrency(workload: Workload, concurrency: int | None) -> Workload:
    """The workload run at `concurrency` in flight: fixed concurrency, except that a Poisson or gamma
    process keeps its arrivals and is capped at `concurrency`."""
    if concurrency is None:
        return workload
    if workload.arrivals.kind in ("poisson", "gamma"):
        return workload.replace(arrivals=replace(workload.arrivals, concurrency=concurrency))
    return workload.replace(arrivals=Arrivals.fixed_concurrency(concurrency))


def _mean(lengths) -> float:
    return (lengths.low + lengths.high) / 2


def _powers_of_two_upto(limit: int) -> list[int]:
    values = [2 ** i for i in range(int(math.log2(limit)) + 1)]
    if values[-1] != limit:
        values.append(limit)
    if len(values) > MAX_CONCURRENCY_POINTS:  # thin from the top down, keeping the limit and 1
        kept = values[::-1][::2][::-1]
        values = kept if kept[0] == 1 else [1, *kept]
    return values


def held_concurrency(capacity: dict, workload: Workload) -> int:
    """Requests the KV pool holds at once without preemption, at the workload's mean lengths."""
    block = int(capacity["block_size"])
    occupancy = _mean(workload.prompt_len) + _mean(workload.output_len) / 2
    per_request = math.ceil(occupancy / block) * block
    return max(1, int(capacity["kv_tokens"]) // per_request)


def propose_space(capacity: dict, workload: Workload) -> SweepSpace:
    """The default sweep, from the KV capacity alone (no run needed).

    A request holds its prompt and, averaged over its life, half its output: occupancy = mean prompt
    length + mean output length / 2 tokens, rounded up to whole blocks. held = kv_tokens // that is the
    concurrency the pool carries without preemption. Concurrency: powers of two up to
    c_max = min(round(1.5 x held), num_requests) (past the pool preempts; past num_requests nothing
    changes), c_max itself included, at most 6 values (every other power dropped when more).
    max_num_seqs: {c_max / 2, c_max} (above the concurrency it changes nothing; below it queues).
    max_num_batched_tokens: {P, 2P, 4P} with P the mean prompt length rounded up to a multiple of 16,
    each at least the largest max_num_seqs (a decode step needs a token per sequence) and at most
    max_model_len x c_max. block_size: {16, 32}. Engine: compile off and on. The mean lengths are the
    workload's declared ones (for a dataset, its `prompt_len` and `output_len`); `layout` stays the
    loaded one.
    """
    missing = [k for k in ("kv_tokens", "block_size", "max_model_len") if k not in capacity]
    if missing:
        raise ValueError(f"propose_space needs capacity keys {missing} (what TuneBackend.capacity() returns)")
    held = held_concurrency(capacity, workload)
    c_max = max(1, min(round(1.5 * held), workload.num_requests))
    seqs = sorted({max(1, c_max // 2), c_max})
    prompt = math.ceil(_mean(workload.prompt_len) / 16) * 16
    ceiling = int(capacity["max_model_len"]) * c_max
    budgets = sorted({min(max(n, seqs[-1]), max(ceiling, seqs[-1])) for n in (prompt, 2 * prompt, 4 * prompt)})
    return SweepSpace(layout=[{}], concurrency=_powers_of_two_upto(c_max),
                      scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": budgets, "block_size": [16, 32]},
                      engine={"compile": [False, True]})


def speculation_values(ks=(2, 4), *, prompt_lookup_max: int | None = None,
                       prompt_lookup_min: int | None = None) -> list[dict | None]:
    """The `speculative_config` knob's values: None (off), then n-gram speculation (prompt lookup) at each k,
    normalised as RunnerConfig keeps them (so a value equal to the loaded one is not applied again). It is
    switched live (runner.reconfigure, no reload): `SweepSpace(scheduler={"speculative_config":
    speculation_values([2, 4])})`."""
    lookup = {key: value for key, value in (("prompt_lookup_max", prompt_lookup_max),
                                            ("prompt_lookup_min", prompt_lookup_min)) if value is not None}
    return [None, *(SpeculativeConfig.check({"method": "ngram", "num_speculative_tokens": k, **lookup})
                    for k in ks)]
