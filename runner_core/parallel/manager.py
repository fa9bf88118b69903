"""ParallelManager: tensor x pipeline parallel ranks on torch.distributed, driven from rank 0.

Layout: rank = pp_rank * tp + tp_rank, so a TP group is consecutive ranks (one node under
torchrun) and the pipeline runs across them. Groups: the default group (NCCL on CUDA, gloo on
the CPU; pipeline sends and receives, timeout `parallel_timeout_s`), one TP group per stage
(same backend and timeout) and a gloo "control" group over every rank with a long timeout,
on which rank 0 broadcasts commands (idle workers wait on it without timing out).

Two ways to start:
  * spawn (a script or a notebook): rank 0 is the caller's process; it hosts a TCPStore on
    127.0.0.1 and its WorkerSupervisor (supervisor.py) starts ranks 1.. with
    torch.multiprocessing's spawn context and watches them: one that exits, or a step in which
    the workers stay silent longer than parallel_timeout_s, ends the runner (every worker's
    process group is killed) and the caller gets a WorkerError naming the rank and the cause.
  * torchrun (env://): every rank runs the same script; rank 0 drives, `load_model()` on the
    other ranks serves rank 0 and exits the process when rank 0 shuts down.

Every rank builds a Worker (its shard of the model, its KV pool with the block count all ranks
agree on; worker_proc.py). Rank 0's LLMEngine schedules and samples, and runs the workers through
`call(method, *args)`: one broadcast of the call (a step's StepBatch, a stateless forward, a compile
switch, a KV move), then every rank runs the same Worker method; the last stage hands its outputs
to rank 0 (`state.to_driver`).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from runner_core.config import RunnerConfig
from runner_core.distributed.parallel_state import COMM_STATS, PipelineStage, parallel_context
from runner_core.errors import ConfigError, RunnerError, WorkerError
from runner_core.parallel.supervisor import WorkerSupervisor

logger = logging.getLogger("runner_core")
_CONTROL_TIMEOUT = timedelta(days=7)  # idle workers wait this long for rank 0's next command
_ACTIVE: ParallelManager | None = None  # torch.distributed's default group is one per process
_HOST = "127.0.0.1"  # spawn mode: rank 0's TCPStore
# what each worker method is called in an error message ("failed during a step")
_OPERATIONS = {"execute_model": "a step", "run_stateless": "a stateless forward", "set_compile_mode": "compilation",
               "move_kv_blocks": "defragmentation"}
_UNWATCHED = ("set_compile_mode",)  # may take minutes: not bounded by parallel_timeout_s


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1)


class ParallelManager:
    def __init__(self, config: RunnerConfig, rank: int, world_size: int, mode: str, stage_ranges: list[range]):
        """`mode`: "spawn" (rank 0 starts the workers) or "torchrun"; `stage_ranges`: each stage's layers."""
        self.config, self.rank, self.world_size, self.mode = config, rank, world_size, mode
        self.tp_size, self.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tp_rank, self.pp_rank = rank % self.tp_size, rank // self.tp_size
        self.stage_ranges = [range(r.start, r.stop) for r in stage_ranges]
        layers = self.stage_ranges[self.pp_rank]
        self.stage = None if self.pp_size == 1 else PipelineStage(
            rank=self.pp_rank, size=self.pp_size, start_layer=layers.start, end_layer=layers.stop,
            prev_rank=rank - self.tp_size if self.pp_rank > 0 else None,
            next_rank=rank + self.tp_size if self.pp_rank < self.pp_size - 1 else None,
            global_rank=rank, last_stage_rank=(self.pp_size - 1) * self.tp_size)
        self.device = config.torch_device
        self.timeout = timedelta(seconds=config.parallel_timeout_s)
        self.store = None
        self.tp_group = self.control = None
        # spawn mode, rank 0: the worker processes; elsewhere empty (it still reads worker errors)
        self.supervisor = WorkerSupervisor(world_size, self.timeout.total_seconds())
        self.state = "starting"  # running, failed, closed
        self.failure: str | None = None
        self.ranks_info: list[dict] = []
        self.worker = None  # this rank's Worker, once built (worker_proc.build_rank)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- start -------------------------------------------------------------------------------
    @classmethod
    def launch(cls, config, stage_ranges: list[range], worker_main) -> ParallelManager:
        """This process's manager: rank 0 spawning the workers (`worker_main` is their entry
        point), or its rank under torchrun."""
        global _ACTIVE
        if _ACTIVE is not None:
            logger.warning("shutting down the previous parallel runner of this process (tp=%d, pp=%d): one "
                           "parallel runner per process", _ACTIVE.tp_size, _ACTIVE.pp_size)
            _ACTIVE.shutdown()
        COMM_STATS.reset()
        if in_torchrun():
            pm = cls._join_torchrun(config, stage_ranges)
        else:
            pm = cls._spawn(config, stage_ranges, worker_main)
        _ACTIVE = pm
        return pm

    @classmethod
    def _join_torchrun(cls, config, stage_ranges) -> ParallelManager:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != config.world_size:
            raise ConfigError(f"torchrun started WORLD_SIZE={world} processes but tensor_parallel_size x "
                              f"pipeline_parallel_size = {config.world_size}; they must be equal")
        if config.torch_device.type == "cuda":
            config = config.replace(device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        pm = cls(config, rank, world, "torchrun", stage_ranges)
        if pm.device.type == "cuda":
            torch.cuda.set_device(pm.device)
        dist.init_process_group(pm.backend, init_method="env://", rank=rank, world_size=world, timeout=pm.timeout)
        pm.store = dist.distributed_c10d._get_default_store()
        pm.init_groups()
        return pm

    @classmethod
    def _spawn(cls, config, stage_ranges, worker_main) -> ParallelManager:
        world = config.world_size
        pm = cls(config, 0, world, "spawn", stage_ranges)
        pm.store = dist.TCPStore(_HOST, 0, world, is_master=True, wait_for_workers=False, timeout=pm.timeout)
        try:
            pm.supervisor.start(worker_main, config, stage_ranges, _HOST, pm.store.port)
            pm.supervisor.wait_ready(pm.store)
            if pm.device.type == "cuda":
                torch.cuda.set_device(pm.device)
            dist.init_process_group(pm.backend, store=pm.store, rank=0, world_size=world, timeout=pm.timeout)
            pm.init_groups()
        except BaseException as e:
            error = pm._startup_error(e)
            if error is e:
                raise
            raise error from e
        return pm

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def init_groups(self) -> None:
        """Every rank creates every group, in the same order (torch.distributed requires it)."""
        self.control = dist.new_group(list(range(self.world_size)), backend="gloo", timeout=_CONTROL_TIMEOUT)
        for s in range(self.pp_size):
            ranks = list(range(s * self.tp_size, (s + 1) * self.tp_size))
            group = dist.new_group(ranks, timeout=self.timeout) if self.tp_size > 1 else None
            if self.rank in ranks:
                self.tp_group = group
        self.state = "running"

    @contextmanager
    def activate(self):
        """This rank's groups and stage, seen by the layers and the worker on this thread."""
        with parallel_context(self.tp_group, self.stage, self.control):
            yield

    # ---- commands (rank 0) ---------------------------------------------------------------------
    def check(self) -> None:
        if self.state == "failed":
            raise WorkerError(f"this parallel runner failed earlier: {self.failure}")
        if self.state != "running":
            raise RunnerError(f"this parallel runner is {self.state}; create a new ModelRunner")

    def call(self, method: str, *args):
        """Run `worker.<method>(*args)` on every rank: one broadcast of the call, then this rank's
        own run; returns rank 0's result. A fault anywhere (a worker died or hung: the supervisor
        times the call unless it is a compile switch) ends the runner with a WorkerError."""
        during = _OPERATIONS.get(method, method)
        self.check()
        self.supervisor.watch(during if self.mode == "spawn" and method not in _UNWATCHED else None)
        try:
            t = time.perf_counter()
            dist.broadcast_object_list([(method, args)], src=0, group=self.control)
            COMM_STATS.add("broadcast", 0, time.perf_counter() - t)
            with self.activate():
                return getattr(self.worker, method)(*args)
        except BaseException as e:
            self._raise_failure(e, during)
        finally:
            self.supervisor.watch(None)

    def _raise_failure(self, e: BaseException, during: str):
        error = self.fail(e, during)
        if isinstance(e, Exception):
            raise error from e
        raise e  # KeyboardInterrupt and the like: the runner is shut down, the interrupt goes on

    def recv_call(self) -> tuple[str, tuple]:
        """The next (method, args) rank 0 broadcasts (workers wait here between calls)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def info(self) -> dict:
        return {"mode": self.mode, "state": self.state, "tensor_parallel_size": self.tp_size,
                "pipeline_parallel_size": self.pp_size, "world_size": self.world_size, "backend": self.backend,
                "stage_layers": [[r.start, r.stop] for r in self.stage_ranges], "ranks": self.ranks_info,
                "comm": COMM_STATS.as_dict()}

    # ---- faults and shutdown -------------------------------------------------------------------
    def fail(self, exc: BaseException | None, during: str) -> WorkerError:
        """End the runner after a fault: name the cause, stop every worker, release the groups."""
        if self.state == "failed":
            return WorkerError(self.failure)
        cause = self.supervisor.wait_for_cause(1.0 if self.mode == "spawn" else 0.0) or (
            f"{type(exc).__name__}: {exc}" if exc is not None else "unknown")
        errors = self.supervisor.worker_errors(self.store)
        self.failure = (f"parallel runner (tensor_parallel_size={self.tp_size}, pipeline_parallel_size="
                        f"{self.pp_size}) failed during {during}: {cause}.{errors} Every worker "
                        "was shut down; create a new ModelRunner to continue")
        self._teardown()
        self.state = "failed"
        return WorkerError(self.failure)

    def _startup_error(self, e: BaseException) -> BaseException:
        if isinstance(e, WorkerError) or self.supervisor.cause is not None or isinstance(e, RuntimeError):
            return self.fail(e, "start-up")
        self.close()
        return e

    def close(self) -> None:
        """Kill the workers without asking them (they may be inside a collective) and release the groups."""
        self._teardown()
        self.state = "closed"

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and release the process groups. Idempotent."""
        if self.state in ("closed", "failed"):
            self._teardown()
            return
        if self.is_driver and self.state == "running":
            self.supervisor.stop()  # workers exiting now is expected, not a fault
            self.state = "closing"
            self.supervisor.watch(None)
            try:
                dist.broadcast_object_list([("shutdown", ())], src=0, group=self.control)
            except Exception:
                pass
            self.supervisor.join(10)
        self.close()

    def _teardown(self) -> None:
        """Kill the workers and release the process groups and the store."""
        global _ACTIVE
        self.supervisor.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.tp_group = self.control = None
        self.store = None
        if _ACTIVE is self:
            _ACTIVE = None


def shutdown_all() -> None:
    """Shut down this process's parallel runner, if any (also run at interpreter exit)."""
    if _ACTIVE is not None:
        _ACTIVE.shutdown()


atexit.register(shutdown_all)
