"""ParallelManager: tensor x pipeline parallel ranks on torch.distributed, driven from rank 0.

Layout: rank = pp_rank * tp + tp_rank, so a TP group is consecutive ranks (one node under
torchrun) and the pipeline runs across them. Groups: the default group (NCCL on CUDA, gloo on
the CPU; pipeline sends and receives, timeout `parallel_timeout_s`), one TP group per stage
(same backend and timeout) and a gloo "control" group over every rank with a long timeout,
on which rank 0 broadcasts commands (idle workers wait on it without timing out).

Two ways to start:
  * spawn (a script or a notebook): rank 0 is the caller's process; it hosts a TCPStore on
    127.0.0.1 and its WorkerSupervisor (worker_supervisor.py) starts ranks 1.. with
    torch.multiprocessing's spawn context and watches them: one that exits, or a step in which
    the workers stay silent longer than parallel_timeout_s, ends the runner (every worker's
    process group is killed) and the caller gets a WorkerError naming the rank and the cause.
  * torchrun (env://): every rank runs the same script; rank 0 drives, `load_model()` on the
    other ranks serves rank 0 and exits the process when rank 0 shuts down.

Every rank builds the same LLMEngine (its shard of the model, its KV pool with the block
count all ranks agree on). Rank 0 schedules and samples; each step it broadcasts the
scheduled batch (`worker.encode_step`) and every rank prepares the same metadata and runs its
part; the last stage sends the logits to rank 0.
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

from runner_core.errors import ConfigError, EngineBusyError, RunnerError, WorkerError
from runner_core.parallel.state import COMM_STATS, PipelineStage, parallel_context, pp_recv, pp_send
from runner_core.parallel.supervisor import WorkerSupervisor

logger = logging.getLogger("runner_core")
_CONTROL_TIMEOUT = timedelta(days=7)  # idle workers wait this long for rank 0's next command
_ACTIVE: "ParallelManager | None" = None  # torch.distributed's default group is one per process
_HOST = "127.0.0.1"  # spawn mode: rank 0's TCPStore
_OPERATIONS = {"step": "a step", "forward": "a stateless forward", "compile": "compilation",
               "defrag": "defragmentation"}


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1)


class ParallelManager:
    def __init__(self, config, rank: int, world_size: int, mode: str, stage_ranges: list[range]):
        self.config, self.rank, self.world_size, self.mode = config, rank, world_size, mode
        self.tp_size, self.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tp_rank, self.pp_rank = rank % self.tp_size, rank // self.tp_size
        self.stage_ranges = [range(r.start, r.stop) for r in stage_ranges]
        layers = self.stage_ranges[self.pp_rank]
        self.stage = None if self.pp_size == 1 else PipelineStage(
            self.pp_rank, self.pp_size, layers.start, layers.stop,
            rank - self.tp_size if self.pp_rank > 0 else None,
            rank + self.tp_size if self.pp_rank < self.pp_size - 1 else None)
        self.device = config.torch_device
        self.timeout = timedelta(seconds=config.parallel_timeout_s)
        self.store = None
        self.tp_group = self.control = None
        # spawn mode, rank 0: the worker processes; elsewhere empty (it still reads worker errors)
        self.supervisor = WorkerSupervisor(world_size, self.timeout.total_seconds())
        self.state = "starting"  # running, failed, closed
        self.failure: str | None = None
        self.ranks_info: list[dict] = []

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def last_stage_rank(self) -> int:
        """Global rank that hands the logits to rank 0 (the last stage's TP rank 0)."""
        return (self.pp_size - 1) * self.tp_size

    # ---- start -------------------------------------------------------------------------------
    @classmethod
    def launch(cls, config, stage_ranges: list[range]) -> "ParallelManager":
        """This process's manager: rank 0 spawning the workers, or its rank under torchrun."""
        global _ACTIVE
        if _ACTIVE is not None:
            logger.warning("shutting down the previous parallel runner of this process (tp=%d, pp=%d): one "
                           "parallel runner per process", _ACTIVE.tp_size, _ACTIVE.pp_size)
            _ACTIVE.shutdown()
        COMM_STATS.reset()
        if in_torchrun():
            pm = cls._join_torchrun(config, stage_ranges)
        else:
            pm = cls._spawn(config, stage_ranges)
        _ACTIVE = pm
        return pm

    @classmethod
    def _join_torchrun(cls, config, stage_ranges) -> "ParallelManager":
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
        pm._init_groups()
        return pm

    @classmethod
    def _spawn(cls, config, stage_ranges) -> "ParallelManager":
        world = config.world_size
        pm = cls(config, 0, world, "spawn", stage_ranges)
        pm.store = dist.TCPStore(_HOST, 0, world, is_master=True, wait_for_workers=False, timeout=pm.timeout)
        try:
            pm.supervisor.start(config, stage_ranges, _HOST, pm.store.port)
            pm.supervisor.wait_ready(pm.store)
            if pm.device.type == "cuda":
                torch.cuda.set_device(pm.device)
            dist.init_process_group(pm.backend, store=pm.store, rank=0, world_size=world, timeout=pm.timeout)
            pm._init_groups()
        except BaseException as e:
            error = pm._startup_error(e)
            if error is e:
                raise
            raise error from e
        return pm

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _init_groups(self) -> None:
        """Every rank creates every group, in the same order (torch.distributed requires it)."""
        self.control = dist.new_group(list(range(self.world_size)), backend="gloo", timeout=_CONTROL_TIMEOUT)
        for s in range(self.pp_size):
            ranks = list(range(s * self.tp_size, (s + 1) * self.tp_size))
            group = dist.new_group(ranks, timeout=self.timeout) if self.tp_size > 1 else None
            if self.rank in ranks:
                self.tp_group = group
        self.state = "running"

    def build_engine(self):
        """Load this rank's shard and build its engine, in step with the other ranks."""
        from runner_core.engine.engine import LLMEngine
        from runner_core.model_loader import ModelLoader

        try:
            with self.activate():
                loaded = ModelLoader(self.config).load()
                dist.barrier(group=self.control)  # loading times differ: meet before the first forward
                engine = LLMEngine(self.config, loaded, parallel=self)
            info = {"rank": self.rank, "pid": os.getpid(), "host": os.uname().nodename, "device": str(self.device),
                    "layers": [self.stage_ranges[self.pp_rank].start, self.stage_ranges[self.pp_rank].stop],
                    "weights_bytes": loaded.weight_bytes, "checkpoint_bytes_read": loaded.bytes_read,
                    "kv_pool_bytes": engine.memory.kv_cache.numel() * engine.memory.kv_cache.element_size()}
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, info, group=self.control)
            self.ranks_info = gathered
        except BaseException as e:
            if not self.is_driver:
                raise
            if isinstance(e, RunnerError) and self.supervisor.cause is None and not isinstance(e, WorkerError):
                # rank 0's own refusal (e.g. a pool too small): the workers are mid-collective, stop them
                self._teardown()
                self.state = "closed"
                raise
            raise self.fail(e, "loading the model") from e
        return loaded, engine

    def agree_pool_plan(self, plan):
        """Every rank's pool gets the smallest block count any rank planned, so that the block
        tables rank 0 hands out are valid everywhere."""
        import dataclasses

        n = torch.tensor([plan.num_blocks], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.control)
        return plan if int(n) == plan.num_blocks else dataclasses.replace(plan, num_blocks=int(n))

    def make_forward_pass(self, model, kv_cache, block_size, device, buffers):
        from runner_core.parallel.worker_proc import DistributedForwardPass

        return DistributedForwardPass(model, kv_cache, block_size, device, buffers, self)

    @contextmanager
    def activate(self):
        with parallel_context(self.tp_group, self.stage):
            yield

    # ---- commands (rank 0) ---------------------------------------------------------------------
    def check(self) -> None:
        if self.state == "failed":
            raise WorkerError(f"this parallel runner failed earlier: {self.failure}")
        if self.state != "running":
            raise RunnerError(f"this parallel runner is {self.state}; create a new ModelRunner")

    def begin(self, kind: str, arg=None, watch: bool = True) -> None:
        """Broadcast a command to the workers; with `watch`, the supervisor times the operation."""
        self.check()
        self.supervisor.watch(_OPERATIONS.get(kind, kind) if watch and self.mode == "spawn" else None)
        try:
            t = time.perf_counter()
            dist.broadcast_object_list([(kind, arg)], src=0, group=self.control)
            COMM_STATS.add("broadcast", 0, time.perf_counter() - t)
        except BaseException as e:
            self._raise_failure(e, _OPERATIONS.get(kind, kind))

    def end(self) -> None:
        self.supervisor.watch(None)

    @contextmanager
    def operation(self, kind: str, arg=None, watch: bool = True):
        self.begin(kind, arg, watch)
        try:
            yield
        except BaseException as e:
            self._raise_failure(e, _OPERATIONS.get(kind, kind))
        finally:
            self.end()

    def _raise_failure(self, e: BaseException, during: str):
        error = self.fail(e, during)
        if isinstance(e, Exception):
            raise error from e
        raise e  # KeyboardInterrupt and the like: the runner is shut down, the interrupt goes on

    def recv_command(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def logits_to_driver(self, logits: torch.Tensor, rows: int, vocab_size: int) -> torch.Tensor:
        """The last stage's logits [rows, vocab] on rank 0 (pipeline parallelism only)."""
        if self.pp_size == 1 or rows == 0:
            return logits
        if self.rank == self.last_stage_rank:
            pp_send(logits, 0)
        elif self.rank == 0:
            return pp_recv((rows, vocab_size), logits.dtype, logits.device, self.last_stage_rank)
        return logits

    # ---- engine operations across ranks (rank 0 calls them; workers run `worker.serve`) ----------
    def forward_stateless(self, engine, rows: list[list[int]]):
        with self.operation("forward", rows):
            return self.run_stateless(engine, rows)

    def run_stateless(self, engine, rows: list[list[int]]):
        """(hidden [N, H], logits [N, V]) of a stateless forward, on rank 0."""
        with self.activate(), torch.inference_mode():
            hidden = engine.forward_pass.run_stateless(rows)
            logits = engine.model.compute_logits(hidden)
            if self.pp_size > 1:
                n, h, v = hidden.shape[0], engine.hf_config.hidden_size, engine.vocab_size
                if self.rank == self.last_stage_rank:
                    pp_send(hidden, 0)
                    pp_send(logits, 0)
                elif self.rank == 0:
                    hidden = pp_recv((n, h), hidden.dtype, hidden.device, self.last_stage_rank)
                    logits = pp_recv((n, v), hidden.dtype, hidden.device, self.last_stage_rank)
        return hidden, logits

    def set_compile_mode(self, engine, enabled: bool, **options) -> dict:
        from runner_core.config import RunnerConfig

        if engine.has_unfinished_requests():
            raise EngineBusyError("cannot change the compile mode while requests are running; "
                                  "wait for them to finish or abort them")
        checked = RunnerConfig.coerce(self.config, **{f"compile_{k}": v for k, v in options.items() if v is not None})
        if self.pp_size > 1 and (options.get("scope") or checked.compile_scope) == "model":
            options["scope"] = "layer"  # stage boundaries (send/recv) stay outside compiled graphs
        with self.operation("compile", {"enabled": enabled, **options}, watch=False):
            with self.activate():
                return engine.set_compile_mode(enabled, **options)

    def defragment(self, engine, shrink_to_blocks: int | None) -> dict:
        """Defragment rank 0's block pool, then move every rank's KV the same way. The slot moves
        are recorded by running the pool's defragmentation on a probe tensor of slot indices."""
        from runner_core.layers.attention import bind_kv_cache
        from runner_core.parallel.worker_proc import apply_slot_mapping

        memory, real = engine.memory, engine.memory.kv_cache
        slots = real.shape[3]
        probe = torch.arange(slots, dtype=torch.int32).view(1, 1, 1, slots, 1).repeat(real.shape[0], 2, 1, 1, 1)
        memory.kv_cache = engine.forward_pass.kv_cache = probe
        try:
            result = engine.defragment(shrink_to_blocks)
            mapping = memory.kv_cache[0, 0, 0, :, 0].long().clone()  # new slot -> old slot
        finally:
            memory.kv_cache = engine.forward_pass.kv_cache = real
            bind_kv_cache(engine.model, real)
        if result["blocks_moved"] or mapping.numel() != slots:
            with self.operation("defrag", mapping):
                apply_slot_mapping(engine, mapping)
        return result

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
        self._teardown()
        self.state = "closed"
        return e

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
                dist.broadcast_object_list([("shutdown", None)], src=0, group=self.control)
            except Exception:
                pass
            self.supervisor.join(10)
        self._teardown()
        self.state = "closed"

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
