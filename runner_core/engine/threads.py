"""How many CPU threads the engine's steps run on (torch's OpenMP pool, which the native kernels share).

The most it uses is the cores this process may run on: its CPU affinity and its cgroup's CPU quota.
An explicit count wins (`RunnerConfig.cpu_threads`, else the environment variable RUNNER_CORE_THREADS);
otherwise `ThreadTuner` adapts to the machine's load from the engine's own steps: it runs a few steps
at each candidate count (all usable cores, half of them, ... one), interleaved, compares the time per
scheduled token of steps of the same kind (decode only or with prompt tokens, of the same size), keeps
the fastest, and checks again after a while or when step time drifts away from what it measured. On a
busy machine a thread that waits at a barrier while its sibling is descheduled costs a time slice per
op; one thread then beats two by a wide margin, on an idle machine two beat one.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from runner_core.errors import ConfigError
from runner_core.openmp_env import TORCH_LOADED_FIRST

ENV_THREADS = "RUNNER_CORE_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process's cgroup may use (quota / period, the smallest along its cgroup's path), or
    None when there is no quota. cgroup v2 (`cpu.max`: "max 100000" or "150000 100000") and v1
    (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 for none)."""
    dirs = [root, root / "cpu", root / "cpu,cpuacct"]  # a container's own view
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or (parts[1] and "cpu" not in parts[1].split(",")):
            continue
        mount = root / parts[1] if parts[1] else root  # v1: one hierarchy per controller; v2: one tree
        here = mount / parts[2].strip("/")
        while here != mount and mount in here.parents:
            dirs.append(here)
            here = here.parent
    limits = [x for x in map(_limit_in, dirs) if x is not None]
    return min(limits) if limits else None


def _limit_in(d: Path) -> float | None:
    v2 = _read(d / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def usable_cores(affinity: set[int] | None = None, cgroup_limit: float | None | str = "read") -> tuple[int, str]:
    """(cores this process may use, why): its CPU affinity, capped by the cgroup's CPU quota (rounded
    down, at least 1). The arguments stand in for the machine's in tests."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    limit = cgroup_cpu_limit() if cgroup_limit == "read" else cgroup_limit
    n, why = len(affinity), f"{len(affinity)} in this process's CPU affinity"
    if limit is not None:
        why += f", cgroup quota {limit:g} CPUs"
        n = max(1, min(n, math.floor(limit)))
    return n, why


def explicit_threads(config_value: int | None) -> tuple[int | None, str]:
    """(count, where it was set) of an explicit thread count: `cpu_threads` in the config, else
    RUNNER_CORE_THREADS; (None, "") when neither is set (or the variable says 'auto')."""
    if config_value is not None:
        return config_value, "cpu_threads in the config"
    raw = os.environ.get(ENV_THREADS, "").strip()
    if raw.lower() in ("", "auto"):
        return None, ""
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"environment variable {ENV_THREADS}={raw!r}; allowed: an int >= 1 (that many CPU "
                          "threads), 'auto' or unset (adapt to the machine's load); fix or unset it")
    return int(raw), ENV_THREADS


def wait_policy() -> str:
    """OpenMP's wait policy in effect: libgomp read it when torch loaded (runner_core/openmp_env.py
    sets passive first unless the user chose, or torch was loaded before runner_core)."""
    policy, spins = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
    if policy or spins:
        return " ".join(x for x in ((policy or "").lower(), f"(GOMP_SPINCOUNT={spins})" if spins else "") if x)
    fix = "; torch was loaded before runner_core: set OMP_WAIT_POLICY=passive before Python starts"
    return "spinning (libgomp's default: waiting threads spin up to 300,000 iterations)" + (
        fix if TORCH_LOADED_FIRST else "")


def candidate_counts(usable: int) -> list[int]:
    """All usable cores, half of them, a quarter, ... down to one: [8, 4, 2, 1], [6, 3, 1], [2, 1]."""
    counts, n = [], usable
    while n > 1:
        counts.append(n)
        n //= 2
    return counts + [1]


class ThreadTuner:
    """The thread count of each step: fixed (`fixed`), left as torch has it (`adaptive=False` without
    `fixed`: a parallel runner's supervisor or a CUDA device decides), or adapted to load from the
    steps' own timings (no extra forward passes)."""

    def __init__(self, usable: int, usable_why: str, fixed: int | None = None, fixed_why: str = "", *,
                 adaptive: bool = True, recheck_s: float = 5.0, max_recheck_s: float = 60.0, rounds: int = 2,
                 drift: float = 1.6, drift_steps: int = 16, clock: Callable[[], float] = time.perf_counter,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads):
        self.usable, self.usable_why = usable, usable_why
        self._set, self._get, self._clock = set_threads, get_threads, clock
        self.restore_to: int | None = None  # torch's count before this tuner first changed it
        self.candidates = candidate_counts(usable) if adaptive and fixed is None else []
        self.count = fixed if fixed is not None else (usable if self.candidates else None)
        self.why = fixed_why
        self.min_recheck_s, self.max_recheck_s, self.recheck_s = recheck_s, max_recheck_s, recheck_s
        self.rounds, self.log_drift = rounds, math.log(drift)
        self.decisions = 0
        self._plan: list[tuple[int, bool]] = []  # (count, timed) of the coming steps while exploring
        self._samples: dict[tuple, dict[int, list[float]]] = {}
        self._baseline: dict[tuple, float] = {}
        self._recent: deque[float] = deque(maxlen=drift_steps)  # log(time / baseline) of recent like steps
        self._decided_at = clock()
        if self.adaptive:
            self.why = f"adaptive: timing the first steps at {' and '.join(map(str, self.candidates))} threads"
            self._explore()

    @classmethod
    def for_engine(cls, cpu_threads: int | None, device: torch.device, world_size: int) -> ThreadTuner:
        """The engine's tuner: an explicit count wins; a CUDA device or a parallel runner keeps torch's count."""
        usable, usable_why = usable_cores()
        count, source = explicit_threads(cpu_threads)
        if world_size > 1:
            return cls(usable, usable_why, None, f"parallel runner: {world_size} ranks share the cores "
                       "(parallel/supervisor.py sets each rank's threads); cpu_threads applies to one process",
                       adaptive=False)
        if device.type != "cpu":
            return cls(usable, usable_why, None, f"{device.type} device: the CPU threads only launch work",
                       adaptive=False)
        if count is not None:
            note = "" if count <= usable else f" (more than the {usable} usable cores)"
            return cls(usable, usable_why, count, f"set by {source}{note}", adaptive=False)
        return cls(usable, usable_why)

    @property
    def adaptive(self) -> bool:
        return len(self.candidates) > 1

    @property
    def exploring(self) -> bool:
        return bool(self._plan)

    def info(self) -> dict:
        """What model_info()["threads"] shows: the count, the usable cores, the policy and why."""
        return {"count": self.count if self.count is not None else self._get(), "usable_cores": self.usable,
                "usable_why": self.usable_why, "policy": "adaptive" if self.adaptive else "fixed", "why": self.why,
                "omp_wait_policy": wait_policy()}

    # ---- the step loop's two calls --------------------------------------------------------------
    def before_step(self) -> None:
        """Set torch's thread count for the coming step (on the calling thread: OpenMP's count is per thread)."""
        want = self._plan[0][0] if self._plan else self.count
        if want is not None and self._get() != want:
            if self.restore_to is None:
                self.restore_to = self._get()
            self._set(want)

    def after_step(self, num_tokens: int, has_prompt_tokens: bool, seconds: float) -> bool:
        """Record a step that scheduled `num_tokens` tokens and took `seconds`; True when the chosen
        count or its reason changed (the caller refreshes what it shows)."""
        if not self.adaptive or num_tokens <= 0:
            return False
        key = (has_prompt_tokens, round(2 * math.log2(num_tokens)))  # steps of one kind, sizes within ~1.4x
        per_token = seconds / num_tokens
        if self._plan:
            count, timed = self._plan.pop(0)
            if timed:
                self._samples.setdefault(key, {}).setdefault(count, []).append(per_token)
            return not self._plan and self._decide()
        base = self._baseline.get(key)
        if base:
            self._recent.append(math.log(per_token / base))
        drifted = len(self._recent) == self._recent.maxlen and abs(statistics.median(self._recent)) > self.log_drift
        if drifted or self._clock() - self._decided_at > self.recheck_s:
            self._explore()
        return False

    # ---- choosing ---------------------------------------------------------------------------------
    def _explore(self) -> None:
        """Plan the next steps: every candidate count for two steps, `rounds` times, the order reversed
        each round (AABBBBAA), so that a slow drift of the machine's speed affects every count alike;
        the first step after a change of count is not timed (it pays for the change)."""
        counts = []
        for r in range(self.rounds):
            counts += [c for c in (self.candidates if r % 2 == 0 else self.candidates[::-1]) for _ in range(2)]
        before = [self.count, *counts[:-1]]
        self._plan, self._samples = [(c, c == b) for c, b in zip(counts, before)], {}
        self._recent.clear()

    def _decide(self) -> bool:
        """Keep the count with the lowest time per token over the step kinds every count ran; True once decided."""
        complete = {k: v for k, v in self._samples.items() if len(v) == len(self.candidates)}
        if not complete:
            if sum(len(x) for v in self._samples.values() for x in v.values()) < 4 * self.rounds * len(self.candidates):
                self._plan = [(c, True) for c in self.candidates]  # the steps changed kind; time each again
                return False
            self._decided_at = self._clock()
            return False
        medians = {k: {c: statistics.median(t) for c, t in v.items()} for k, v in complete.items()}
        score = {c: statistics.fmean(math.log(m[c] / min(m.values())) for m in medians.values())
                 for c in self.candidates}
        best = min(self.candidates, key=score.__getitem__)
        others = sorted((c for c in self.candidates if c != best), key=score.__getitem__)
        ratio = math.exp(score[others[0]] - score[best])
        changed = best != self.count or self.decisions == 0
        self.recheck_s = self.min_recheck_s if changed else min(self.max_recheck_s, 2 * self.recheck_s)
        self.count, self.decisions, self._decided_at = best, self.decisions + 1, self._clock()
        self._baseline = {k: m[best] for k, m in medians.items()}
        self.why = (f"adaptive: {best} thread{'s' if best > 1 else ''} ran {ratio:.2f}x as fast per token as "
                    f"{others[0]} over the last {sum(len(x) for v in complete.values() for x in v.values())} "
                    f"timed steps; checked again within {self.recheck_s:g} s or when step time drifts")
        return True

    def close(self) -> None:
        """Give torch back the thread count it had before this tuner changed it."""
        if self.restore_to is not None and self._get() != self.restore_to:
            self._set(self.restore_to)
        self.restore_to = None
