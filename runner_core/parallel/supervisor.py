"""WorkerSupervisor: rank 0's hold on the worker processes of a spawned parallel runner.

It starts ranks 1.. (sharing the CPU cores with them), waits until each reaches its process-group
setup, and watches them from a monitor thread: a worker that exits, or an operation with no answer
for longer than parallel_timeout_s, becomes the `cause`, and every worker is killed so that rank
0's blocked collective fails at once. It also reads the tracebacks workers leave in the store.
Under torchrun nothing is spawned: the supervisor stays empty and only reads those reports.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from runner_core.errors import WorkerError

logger = logging.getLogger("runner_core")


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _proc_state(pid: int) -> str:
    """The process state letter from /proc (R, S, D, T, Z...), '' when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class WorkerSupervisor:
    """The manager tells it what is in flight (`watch`) and reads `cause`, the monitor's verdict
    (None while every worker is healthy); `close` ends the workers."""

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.procs: dict[int, object] = {}  # rank -> Process
        self.op: tuple[str, float] | None = None  # (what is in flight, e.g. "a step"; since when), timed
        self.cause: str | None = None  # set by the monitor: a worker died or hung
        self._stop = threading.Event()
        self._threads_before: int | None = None

    def start(self, worker_main, config, stage_ranges: list[range], host: str, port: int) -> None:
        """Start ranks 1.. running `worker_main` on the spawn context (they join the store at
        host:port), then the monitor."""
        import torch.multiprocessing as mp

        device, threads = config.torch_device, 0
        if device.type == "cpu":  # share the cores: every rank computes at the same time
            threads = max(1, torch.get_num_threads() // self.world_size)
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        ctx = mp.get_context("spawn")
        ranges = [(r.start, r.stop) for r in stage_ranges]
        for r in range(1, self.world_size):
            cfg = config.to_dict()
            if device.type == "cuda":
                cfg["device"] = f"cuda:{device.index + r}"
            proc = ctx.Process(target=worker_main, name=f"runner-worker-{r}", daemon=True,
                               args=(r, self.world_size, host, port, cfg, ranges, os.getpid(), threads))
            proc.start()
            self.procs[r] = proc
        threading.Thread(target=self._monitor, name="runner-parallel-monitor", daemon=True).start()

    def wait_ready(self, store) -> None:
        """Wait for every worker to reach its process-group setup, watching that none died."""
        for r in self.procs:
            while True:
                if self.cause is not None:
                    raise WorkerError(self.cause)
                if store.check([f"runner/ready/{r}"]):
                    break
                time.sleep(0.02)

    def watch(self, during: str | None) -> None:
        """Time the operation now in flight (`during` as in "during a step"); None: nothing is."""
        self.op = None if during is None else (during, time.monotonic())

    def wait_for_cause(self, seconds: float) -> str | None:
        """The cause, once the monitor had up to `seconds` to attribute a broken collective to a
        dead worker."""
        deadline = time.monotonic() + seconds
        while self.cause is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.cause

    def _monitor(self) -> None:
        """A worker that exits, or an operation with no answer for longer than parallel_timeout_s,
        ends the runner (the blocked collective then fails at once)."""
        limit = self.timeout_s
        while not self._stop.wait(0.1):
            for r, proc in self.procs.items():
                if proc.exitcode is not None:
                    self.cause = f"worker rank {r} (pid {proc.pid}) {_describe_exit(proc.exitcode)}"
                    break
            op = self.op
            if self.cause is None and op is not None and time.monotonic() - op[1] > limit:
                stopped = [f"rank {r} (pid {p.pid}) is stopped" for r, p in self.procs.items()
                           if _proc_state(p.pid) in ("T", "t")]
                self.cause = (f"the workers did not answer for {limit:g} s during {op[0]} "
                              f"(parallel_timeout_s): a worker hung{' - ' + ', '.join(stopped) if stopped else ''}")
            if self.cause is not None:
                logger.error("parallel runner: %s; shutting every worker down", self.cause)
                self.kill()
                return

    def worker_errors(self, store) -> str:
        """A " Worker rank r reported: <last line of its traceback>" for each worker that left one."""
        out = []
        for r in range(1, self.world_size):
            try:
                if store is not None and store.check([f"runner/error/{r}"]):
                    text = store.get(f"runner/error/{r}").decode(errors="replace").strip().splitlines()
                    out.append(f" Worker rank {r} reported: {text[-1] if text else '?'}")
            except Exception:  # the store may be gone with the worker that hosted it (torchrun)
                break
        return "".join(out)

    def stop(self) -> None:
        """Stop watching: workers exiting from now on is expected, not a fault."""
        self._stop.set()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.pid is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.kill()
            except (OSError, ValueError):
                pass

    def join(self, seconds: float) -> None:
        """Give the workers up to `seconds` in all to exit on their own."""
        deadline = time.monotonic() + seconds
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop watching, kill and reap every worker, and give rank 0 its CPU threads back."""
        self.stop()
        self.kill()
        for proc in self.procs.values():
            proc.join(5)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
