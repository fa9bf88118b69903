"""Worker: every rank's part of the engine — its model (or shard), its KV pool, the forward pass and
the compile mode. Rank 0's LLMEngine runs the worker's methods through an executor's single
`call(method, *args)`: `LocalExecutor` in one process; the ParallelManager broadcasts the call so
that every rank runs the same method on its own worker (vLLM's collective RPC, nano-vllm's `call`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

import torch

from runner_core import faults
from runner_core.compile import (
    WARMUP_SIZES,
    CompileOptimizer,
    build_decode_programs,
    cuda_capture_plan,
    cuda_graphs_status,
)
from runner_core.compile.decode_plan import default_sizes
from runner_core.config import RunnerConfig, resolve_max_model_len
from runner_core.distributed.parallel_state import min_over_ranks, to_driver
from runner_core.engine.encoder_cache import EncoderCache
from runner_core.engine.forward_pass import ForwardPass
from runner_core.engine.input_batch import StepBatch
from runner_core.errors import CompileError
from runner_core.layers.attention import set_forward_context
from runner_core.layers.moe_record import recording_routing
from runner_core.loader.model_loader import LoadedModel
from runner_core.memory import (
    MemoryManager,
    ModelShape,
    PoolPlan,
    dummy_batch,
    kv_bytes_per_token,
    plan_kv_pool,
    profile_activation_peak,
)
from runner_core.memory.draft import draft_share

logger = logging.getLogger("runner_core")


def wait_for_device(device: torch.device) -> None:
    """Wait until `device` has run what was launched on it: CUDA runs kernels asynchronously, so a clock read
    after a forward's launch would count its GPU time in the next phase (sampling). Nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Worker:
    def __init__(self, config: RunnerConfig, loaded: LoadedModel):
        self.config, self.model, self.hf_config = config, loaded.model, loaded.hf_config
        self.weights_bytes = loaded.weight_bytes
        self.is_moe = callable(getattr(self.model, "expert_counts", None))  # routing reported per step
        self.device, self.dtype = config.torch_device, config.torch_dtype
        text = self.hf_config.get_text_config()  # a multimodal config's text model
        self.vocab_size, self.hidden_size = text.vocab_size, text.hidden_size
        self.max_model_len = resolve_max_model_len(config.max_model_len, text.max_position_embeddings)
        self.forward_pass = self._make_forward_pass()
        self.model_bytes = loaded.weight_bytes + loaded.buffer_bytes
        self._allocate_pool(self._plan_pool(self.model_bytes))
        if self.device.type == "cuda":
            self.warm_up_attention()
        multimodal = loaded.adapter.kind == "multimodal"
        self.encoder_cache = EncoderCache(config.effective_encoder_cache_tokens) if multimodal else None
        self.compiler: CompileOptimizer | None = None
        if config.compile and not config.enforce_eager:
            self.set_compile_mode(True)

    def _make_forward_pass(self) -> ForwardPass:
        """A forward pass whose input buffers hold a step at this config's limits."""
        config, bs = self.config, self.config.block_size
        return ForwardPass(self.model, bs, self.device, max_tokens=config.effective_max_num_batched_tokens,
                           max_seqs=config.max_num_seqs, max_blocks_per_seq=-(-self.max_model_len // bs),
                           attention_backend=config.attention_backend)

    def _allocate_pool(self, plan: PoolPlan) -> None:
        """A MemoryManager with the planned pool, bound to the model's attention layers."""
        self.pool_plan, model = plan, self.model
        self.memory = MemoryManager(plan.num_blocks, plan.block_size, self.config.enable_prefix_caching)
        self.memory.allocate_kv_cache(model, model.num_layers, model.num_kv_heads, model.head_dim, self.dtype,
                                      self.device)
        logger.info(plan.describe())

    def _plan_pool(self, model_bytes: int) -> PoolPlan:
        """The KV pool for what is left (sizing.py); every rank gets the smallest block count any rank
        planned, so the block tables rank 0 hands out are valid everywhere."""
        config, model = self.config, self.model
        measured, reserve = None, 0
        if self.device.type == "cuda":
            if config.kv_cache_memory is None:  # the profile run decides the pool size
                measured = self.measure_activation_peak(config.effective_max_num_batched_tokens, config.max_num_seqs)
                torch.cuda.empty_cache()  # hand the profile's cached blocks back before measuring what is left
            total = torch.cuda.mem_get_info(self.device)[1]
            reserve = cuda_capture_plan(config, self.hf_config, self.max_model_len, total)[1]
        per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, self.dtype)
        draft = draft_share(config, self.max_model_len) or (0, 0)  # a draft model's pool holds as many tokens
        plan = plan_kv_pool(config, ModelShape.from_hf_config(self.hf_config), self.max_model_len,
                            bytes_per_token=per_token + draft[0], weights_bytes=model_bytes + draft[1],
                            attention_backend=self.forward_pass.attention_backend,
                            measured_peak_bytes=measured, reserved_bytes=reserve)
        if draft[0]:
            plan = dataclasses.replace(plan, bytes_per_token=per_token)
        num_blocks = min_over_ranks(plan.num_blocks)
        if num_blocks != plan.num_blocks:
            plan = dataclasses.replace(plan, num_blocks=num_blocks)
        plan.check_holds(self.max_model_len)
        return plan

    def measure_activation_peak(self, num_tokens: int, num_seqs: int) -> int:
        """Peak bytes of one stateless forward over `dummy_batch(num_tokens, num_seqs)` plus float32
        logits for the rows the engine would sample (memory/profile.py)."""
        seqs, rows = dummy_batch(num_tokens, num_seqs), min(num_seqs, num_tokens)

        def run() -> None:
            hidden = self.forward_pass.run_stateless(seqs)
            with torch.inference_mode():
                self.model.compute_logits(hidden[:rows]).float()

        return profile_activation_peak(run, self.device)

    def warm_up_attention(self) -> None:
        """The flex backend (CUDA's default), before the first request: run its kernels over the pool on the
        busiest step (`dummy_batch`'s shape) and on a second shape, so the Triton kernels are compiled now
        (dynamic in the token count), not during the first requests (tens of seconds each); and measure that
        step's peak. The profile run before the pool was planned ran the gather backend; where flex's step
        peaks higher, a pool sized from the device's memory gives the difference back. Block 0, which the
        dummy steps write, keeps its contents."""
        fp, config, plan = self.forward_pass, self.config, self.pool_plan
        if fp.attention_backend != "flex":
            return
        tokens, seqs = config.effective_max_num_batched_tokens, config.max_num_seqs
        # the busiest step: dummy_batch's decodes, its prefill in pieces of at most max_model_len (as scheduled)
        busiest = sorted(map(len, dummy_batch(tokens, seqs)))
        rest, busiest, cap = busiest[-1], busiest[:-1], fp.buffers.max_blocks * fp.block_size
        while rest > 0 and len(busiest) < seqs:
            busiest.append(min(rest, cap))
            rest -= busiest[-1]

        def run(q_lens: list[int]) -> None:
            ids, positions, meta = fp.dummy_step(q_lens)
            with torch.inference_mode(), set_forward_context(meta, True):
                self.model.compute_logits(self.model(ids, positions)[:len(q_lens)]).float()

        with self.memory.block_kept(0):
            peak = profile_activation_peak(lambda: run(busiest), self.device)
            run([1] * max(1, len(busiest) // 2))  # another shape: the compiled kernel takes any token count
        excess = peak - plan.activation_peak_bytes
        if excess <= 0 or plan.source != "gpu_memory_utilization":
            return
        block_bytes = plan.bytes_per_token * plan.block_size
        keep = min_over_ranks(self.memory.num_blocks - -(-excess // block_bytes))
        logger.info("flex attention's step peaks %.1f MiB above the planned activation peak: the KV pool gives "
                    "back %d blocks", excess / 2**20, self.memory.num_blocks - keep)
        self.pool_plan = dataclasses.replace(plan, num_blocks=keep, activation_peak_bytes=peak)
        self.pool_plan.check_holds(self.max_model_len)
        self.memory.shrink(keep)

    # ---- what rank 0 calls on every rank ------------------------------------------------------
    def execute_model(self, batch: StepBatch) -> tuple[torch.Tensor, float, torch.Tensor | None]:
        """(logits [sampling rows + prompt-logprob rows, vocab] float32, seconds spent preparing the inputs,
        and for an MoE model the step's tokens per expert [MoE layers, experts], pad rows excluded) on rank 0."""
        t = time.perf_counter()
        self.memory.copy_blocks(batch.block_copies)  # copies on write, before the forward writes the blocks
        inp = self.forward_pass.prepare(faults.fire("forward", batch),
                                        self._image_features(batch) if batch.images else None)
        prepared = time.perf_counter() - t
        with recording_routing(inp.num_pad_tokens) as routing:
            logits = faults.fire("logits", self.forward_pass.execute(inp))
        wait_for_device(self.device)  # the step's forward ends when the device's work does, not at its launch
        counts = self.model.expert_counts(routing) if self.is_moe else None
        return to_driver(logits, (batch.num_logits, self.vocab_size)), prepared, counts

    def _image_features(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, feature rows) of the step's image tokens; each image is encoded once
        and kept in the encoder cache while it has room."""
        features = self.encoder_cache.features([(h, px) for _, h, _, _, px in batch.images],
                                                self.model.get_image_features)
        positions = torch.cat([torch.arange(flat, flat + n) for flat, _, _, n, _ in batch.images])
        rows = torch.cat([features[h][first:first + n] for _, h, first, n, _ in batch.images])
        return positions.to(self.device), rows

    def run_stateless(self, rows: list[list[int]], output_router_logits: bool = False) -> tuple[torch.Tensor, ...]:
        """(hidden [N, H], logits [N, V]) of a causal forward of independent rows without the KV pool;
        with `output_router_logits` (an MoE model) also the router logits [MoE layers, N, experts]."""
        with recording_routing(capture_logits=output_router_logits) as routing:
            hidden, back = self.forward_pass.run_stateless(rows, return_order=True)
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden)
        n = hidden.shape[0]
        out = to_driver(hidden, (n, self.hidden_size)), to_driver(logits, (n, self.vocab_size))
        if output_router_logits:
            return *out, self.model.router_logits(routing, n)[:, back]
        return out

    def set_compile_mode(self, enabled: bool, backend: str | None = None, mode: str | None = None,
                         scope: str | None = None) -> dict:
        """Compile (or un-compile) the loaded model without reloading weights; warms up now and builds
        the decode programs. A compile error falls back to eager with a warning unless
        `compile_fallback=False`."""
        optimizer = CompileOptimizer.create(self.config, self.hf_config, enabled=enabled, backend=backend, mode=mode,
                                            scope=scope)
        fp = self.forward_pass
        self._drop_decode_programs()
        try:
            optimizer.apply(faults.fire("compile", self.model))
            optimizer.warm_up(fp.run_dummy, WARMUP_SIZES)
            fp.decode_programs, reason = build_decode_programs(optimizer, self.config, self.hf_config, self.model, fp,
                                                               self.memory, self.max_model_len)
            optimizer.finish_warm_up(reason)
        except Exception as e:
            self._drop_decode_programs()
            optimizer.reset(self.model)
            if not self.config.compile_fallback:
                raise CompileError(f"compiling with {optimizer.settings} failed: {type(e).__name__}: {e}") from e
            logger.warning("compiling with backend=%s mode=%s failed (%s: %s); running eager instead "
                           "(compile_fallback=False makes this an error)", optimizer.settings.backend,
                           optimizer.settings.mode, type(e).__name__, e)
            optimizer = CompileOptimizer.create(self.config, self.hf_config, enabled=False)
            optimizer.settings.reason = f"fell back to eager: {type(e).__name__}: {e}"
        self.compiler = optimizer
        return self.compile_stats()

    def reconfigure(self, config: RunnerConfig, groups: tuple[str, ...]) -> dict:
        """Run under `config`, a validated change of RECONFIGURABLE fields in `groups`, on an idle engine:
        input buffers sized anew, the KV pool re-planned (rebuilt, prefix cache dropped, when its
        settings changed or the new limits plan more blocks, or on CUDA fewer), the decode programs
        kept where still valid, else rebuilt (with a compile change: left to `set_compile_mode`, called next).
        Returns {"pool": whether the pool was rebuilt}. A plan that cannot hold one
        sequence raises ConfigError with nothing changed."""
        old, old_fp = self.config, self.forward_pass
        self.config = config
        try:
            self.forward_pass = self._make_forward_pass()
            plan = self._plan_pool(self.model_bytes)
        except Exception:
            self.config, self.forward_pass = old, old_fp
            raise
        blocks = self.memory.num_blocks
        rebuild_pool = ("pool" in groups or plan.num_blocks > blocks
                        or (self.device.type == "cuda" and plan.num_blocks < blocks))
        programs = old_fp.decode_programs
        had_programs, resized = programs is not None, self._decode_sizes(old) != self._decode_sizes(config)
        # CPU packages take the pool and the inputs at every call: valid while their sizes are
        keep = had_programs and "compile" not in groups and not programs.holds_pool_address and not resized
        if programs is not None and not keep:
            old_fp.decode_programs = None
            programs.release()
            programs = None  # CUDA graphs: their memory goes before the new pool's
        if rebuild_pool:
            self.memory.release_kv_cache()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._allocate_pool(plan)
            if self.device.type == "cuda":
                self.warm_up_attention()
        cache_tokens = config.effective_encoder_cache_tokens
        if self.encoder_cache is not None and old.effective_encoder_cache_tokens != cache_tokens:
            self.encoder_cache = EncoderCache(cache_tokens)
        compiled = self.compiler is not None and self.compiler.settings.enabled
        if keep:
            self.forward_pass.decode_programs = old_fp.decode_programs
        elif compiled and "compile" not in groups and (had_programs or resized):
            self.forward_pass.decode_programs, reason = build_decode_programs(
                self.compiler, config, self.hf_config, self.model, self.forward_pass, self.memory, self.max_model_len)
            self.compiler.decode_reason = reason
        return {"pool": rebuild_pool}

    def _decode_sizes(self, config: RunnerConfig) -> list[int]:
        """The decode batch sizes `config` asks programs for (those up to max_num_seqs)."""
        sizes = config.compile_sizes
        if sizes is None:
            sizes = default_sizes(self.device.type, config.max_num_seqs)
        return [s for s in sizes if s <= config.max_num_seqs]

    def move_kv_blocks(self, moves: dict[int, int], num_blocks: int) -> None:
        """Defragmentation on this rank: copy the K/V of each moved block and renumber them in the block
        tables, then cut the pool to `num_blocks` (rank 0 renumbered its blocks already:
        MemoryManager.compact). A cut pool is a new tensor: decode programs that hold the old one's
        address (CUDA graphs) are rebuilt."""
        self.memory.move_blocks(moves)
        self.forward_pass.buffers.block_table.move(moves)
        blocks = self.memory.num_blocks  # (no reference to the old pool: the shrink may release it first)
        self.memory.shrink(num_blocks)
        programs = self.forward_pass.decode_programs
        if programs is not None and programs.holds_pool_address and self.memory.num_blocks != blocks:
            self._rebuild_decode_programs()

    def _drop_decode_programs(self) -> None:
        """Steps run the general program from now on; what the decode programs held is released."""
        programs, self.forward_pass.decode_programs = self.forward_pass.decode_programs, None
        if programs is not None:
            programs.release()

    def _rebuild_decode_programs(self) -> None:
        """Rebuild the decode programs over the moved pool. Their warm-up writes dummy K/V into
        block 0, which may hold a live sequence's keys now: its contents are kept. If the rebuild
        fails the programs are dropped (steps run the general program) and the error is raised."""
        fp = self.forward_pass
        try:
            with self.memory.block_kept(0):
                fp.decode_programs.rebuild(fp.dummy_decode)
        except Exception:
            fp.decode_programs = None
            raise

    # ---- figures ------------------------------------------------------------------------------
    def compile_stats(self) -> dict:
        if self.compiler is None:
            return {"enabled": False, "backend": None, "mode": None, "scope": None, "cache": "off",
                    "compile_seconds": {}, "recompiles_after_warmup": 0, "graph_breaks": 0, "warm_start": None,
                    "cuda_graphs": cuda_graphs_status(self.device.type, None, False)}
        return self.compiler.stats(self.forward_pass.decode_programs)

    def memory_bytes(self) -> dict:
        """This rank's weights, KV pool, planned activation peak and decode programs, in bytes."""
        programs = self.forward_pass.decode_programs
        out = {"weights_bytes": self.weights_bytes, "kv_pool_bytes": self.memory.kv_cache_bytes,
               "kv_bytes_per_token": self.pool_plan.bytes_per_token,
               "activation_peak_bytes": self.pool_plan.activation_peak_bytes,
               # CPU: the decode programs' prepacked weights; CUDA: their graphs' memory pool
               "decode_programs_bytes": programs.memory_bytes if programs is not None else 0}
        if self.encoder_cache is not None:
            cache = self.encoder_cache.stats()
            out.update({"encoder_cache_tokens": cache["tokens"], "encoder_cache_images": cache["images"],
                        "encoder_cache_hits": cache["hits"], "encoder_cache_misses": cache["misses"]})
        return out


class Executor(Protocol):
    """Runs Worker methods on every rank: `call` returns this rank's (rank 0's) result. LocalExecutor
    in one process; parallel/manager.ParallelManager across ranks."""

    def call(self, method: str, *args): ...

    def info(self) -> dict | None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """Runs the worker's methods in this process: the executor of a one-rank runner."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def info(self) -> None:
        """No parallel ranks (ModelRunner.parallel_info)."""
        return None

    def shutdown(self) -> None:
        pass
