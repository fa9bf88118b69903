"""The worker side of a parallel runner: the spawned process's entry point, the command loop,
and the forward pass that every rank runs on the batch rank 0 scheduled.

A step's command carries, for each scheduled sequence, what `ForwardPass.prepare` reads:
where its new tokens start, how many, those token ids, its block table and whether it
samples. Workers wrap these in `SeqView`s and call the same `prepare`, so every rank builds
bit-identical positions, slot mappings and attention metadata over its own pool shard.
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

from runner_core.engine.forward_pass import ForwardPass, ModelInput

logger = logging.getLogger("runner_core")


# ---- the step's batch on the wire ------------------------------------------------------------
def encode_step(scheduled) -> list[tuple]:
    """(start, num_new_tokens, new token ids, block table, samples) per scheduled sequence."""
    out = []
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        out.append((start, n, seq.token_ids[start:start + n], seq.block_table, start + n == seq.num_tokens))
    return out


class _Chunk:
    """The token ids a worker sees of a sequence: only this step's new ones."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, index: slice) -> list[int]:
        if index.start != self.start or index.stop != self.start + len(self.ids):
            raise IndexError(f"a worker holds tokens [{self.start}, {self.start + len(self.ids)}) of this "
                             f"sequence, not [{index.start}, {index.stop})")
        return self.ids


class SeqView:
    """What ForwardPass.prepare reads of a Sequence, rebuilt on a worker from `encode_step`."""

    __slots__ = ("num_computed_tokens", "token_ids", "block_table", "num_tokens")

    def __init__(self, start: int, n: int, ids: list[int], block_table: list[int], samples: bool):
        self.num_computed_tokens, self.token_ids, self.block_table = start, _Chunk(start, ids), block_table
        self.num_tokens = start + n if samples else start + n + 1


def decode_step(payload: list[tuple]) -> list[tuple[SeqView, int]]:
    return [(SeqView(*item), item[1]) for item in payload]


class DistributedForwardPass(ForwardPass):
    """ForwardPass of a parallel runner: on rank 0, `prepare` first broadcasts the batch; every
    rank runs its shard/stage in `execute`, and rank 0 gets the logits."""

    def __init__(self, model, kv_cache, block_size, device, buffers, parallel):
        super().__init__(model, kv_cache, block_size, device, buffers)
        self.parallel = parallel
        self.vocab_size = model.config.vocab_size

    def prepare(self, scheduled) -> ModelInput:
        pm = self.parallel
        if not pm.is_driver:
            return super().prepare(scheduled)
        pm.begin("step", encode_step(scheduled))
        try:
            return super().prepare(scheduled)
        except BaseException as e:
            pm.end()
            pm._raise_failure(e, "a step")

    def execute(self, inp: ModelInput) -> torch.Tensor:
        pm = self.parallel
        try:
            with pm.activate():
                logits = super().execute(inp)
                return pm.logits_to_driver(logits, len(inp.sampling_seqs), self.vocab_size)
        except BaseException as e:
            if not pm.is_driver:
                raise
            pm._raise_failure(e, "a step")
        finally:
            pm.end()


def apply_slot_mapping(engine, mapping: torch.Tensor) -> None:
    """Move this rank's KV so that new slot i holds old slot mapping[i] (defragmentation), and
    cut the pool to len(mapping) slots when it shrank."""
    from runner_core.layers.attention import bind_kv_cache

    kv = engine.memory.kv_cache
    mapping = mapping.to(kv.device)
    n = mapping.numel()
    moved = (mapping != torch.arange(n, device=kv.device)).nonzero().squeeze(1)
    if moved.numel():
        kv[:, :, :, moved] = kv[:, :, :, mapping[moved]]
    if n < kv.shape[3]:
        kv = kv[:, :, :, :n].clone()
    engine.memory.kv_cache = engine.forward_pass.kv_cache = kv
    bind_kv_cache(engine.model, kv)


# ---- the command loop ------------------------------------------------------------------------
def serve(pm, engine) -> None:
    """Run rank 0's commands until it says shutdown."""
    fp = engine.forward_pass
    while True:
        kind, arg = pm.recv_command()
        if kind == "step":
            fp.execute(fp.prepare(decode_step(arg)))
        elif kind == "forward":
            pm.run_stateless(engine, arg)
        elif kind == "compile":
            with pm.activate():
                engine.set_compile_mode(arg.pop("enabled"), **arg)
        elif kind == "defrag":
            apply_slot_mapping(engine, arg)
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")


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
    from runner_core.config import RunnerConfig
    from runner_core.parallel.manager import ParallelManager

    pm, code = None, 0
    try:
        cfg = RunnerConfig(config)
        pm = ParallelManager(cfg, rank, world_size, "spawn", [range(a, b) for a, b in stage_ranges])
        pm.store = dist.TCPStore(host, port, world_size, is_master=False, timeout=pm.timeout)
        if pm.device.type == "cuda":
            torch.cuda.set_device(pm.device)
        pm.store.set(f"runner/ready/{rank}", "1")
        dist.init_process_group(pm.backend, store=pm.store, rank=rank, world_size=world_size, timeout=pm.timeout)
        pm._init_groups()
        _, engine = pm.build_engine()
        serve(pm, engine)
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

