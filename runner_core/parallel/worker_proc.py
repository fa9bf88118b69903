"""A parallel runner's ranks as processes: starting them and building every rank's Worker in step
(`launch`, `build_rank`), the spawned process's entry point (`worker_main`) and the loop in which a
worker runs rank 0's calls (`serve`: receive (method, args), run that Worker method; no command
switch). Only the façade imports this module: it builds the engine's workers.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from runner_core.config import RunnerConfig
from runner_core.engine.worker import Worker
from runner_core.errors import RunnerError, WorkerError
from runner_core.loader.model_loader import LoadedModel, ModelLoader
from runner_core.parallel.manager import ParallelManager

logger = logging.getLogger("runner_core")


def launch(config: RunnerConfig, stage_ranges: list[range]) -> tuple[ParallelManager, LoadedModel]:
    """Start the ranks (spawned from here, or this process's rank under torchrun) and build this
    rank's worker in step with the others; rank 0 gets its manager (the engine's executor, holding
    rank 0's worker) and its loaded model. Under torchrun, ranks > 0 serve rank 0 inside this call
    and exit the process when rank 0 shuts down."""
    pm = ParallelManager.launch(config, stage_ranges, worker_main)
    try:
        loaded = build_rank(pm)
    except BaseException:
        if not pm.is_driver:
            report_error(pm, pm.rank)
        raise
    if not pm.is_driver:  # torchrun rank > 0
        try:
            serve(pm)
        except BaseException:
            report_error(pm, pm.rank)
            raise
        pm.shutdown()
        raise SystemExit(0)
    return pm, loaded


def build_rank(pm: ParallelManager) -> LoadedModel:
    """Load this rank's shard and build its Worker, in step with the other ranks."""
    try:
        with pm.activate():
            loaded = ModelLoader(pm.config).load()
            dist.barrier(group=pm.control)  # loading times differ: meet before the first forward
            pm.worker = Worker(pm.config, loaded)
        layers = pm.stage_ranges[pm.pp_rank]
        info = {"rank": pm.rank, "pid": os.getpid(), "host": os.uname().nodename, "device": str(pm.device),
                "layers": [layers.start, layers.stop], "weights_bytes": loaded.weight_bytes,
                "checkpoint_bytes_read": loaded.bytes_read, "kv_pool_bytes": pm.worker.memory.kv_cache_bytes}
        gathered: list = [None] * pm.world_size
        dist.all_gather_object(gathered, info, group=pm.control)
        pm.ranks_info = gathered
    except BaseException as e:
        if not pm.is_driver:
            raise
        if isinstance(e, RunnerError) and pm.supervisor.cause is None and not isinstance(e, WorkerError):
            pm.close()  # rank 0's own refusal (e.g. a pool too small): the workers are mid-collective
            raise
        raise pm.fail(e, "loading the model") from e
    return loaded


def serve(pm: ParallelManager) -> None:
    """Run rank 0's calls on this rank's worker until it says shutdown."""
    while True:
        method, args = pm.recv_call()
        if method == "shutdown":
            return
        with pm.activate():
            getattr(pm.worker, method)(*args)


def report_error(pm, rank: int) -> None:
    """Leave this rank's traceback in the store, for rank 0's error message."""
    try:
        if pm is not None and pm.store is not None:
            pm.store.set(f"runner/error/{rank}", traceback.format_exc()[-4000:])
    except Exception:
        pass


def _watch_parent(parent_pid: int) -> None:
    """Exit (with everything this worker started) as soon as rank 0's process is gone."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                try:
                    os.killpg(0, 9)
                finally:
                    os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="runner-parent-watch", daemon=True).start()


def worker_main(rank: int, world_size: int, host: str, port: int, config: dict, stage_ranges: list,
                parent_pid: int, num_threads: int) -> None:
    """Entry point of a spawned worker (ranks 1..world-1)."""
    os.setpgid(0, 0)  # its own process group, so rank 0 can kill it and anything it starts
    _watch_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    if num_threads:
        torch.set_num_threads(num_threads)
    pm, code = None, 0
    try:
        cfg = RunnerConfig(config)
        pm = ParallelManager(cfg, rank, world_size, "spawn", [range(a, b) for a, b in stage_ranges])
        pm.store = dist.TCPStore(host, port, world_size, is_master=False, timeout=pm.timeout)
        if pm.device.type == "cuda":
            torch.cuda.set_device(pm.device)
        pm.store.set(f"runner/ready/{rank}", "1")
        dist.init_process_group(pm.backend, store=pm.store, rank=rank, world_size=world_size, timeout=pm.timeout)
        pm.init_groups()
        build_rank(pm)
        serve(pm)
    except BaseException:
        report_error(pm, rank)
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    sys.stdout.flush()
    sys.exit(code)

