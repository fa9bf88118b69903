"""LLMEngine: the step loop. Admits requests, schedules, runs ForwardPass and the sampler, hands
sampled tokens to the OutputProcessor and releases finished requests; owns the KV pool, the
compile mode and the per-step metrics. One bad request never stops it."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from runner_core.config import RunnerConfig
from runner_core.compile.compile_optimizer import CompileOptimizer, cuda_graphs_status
from runner_core.compile.decode_programs import CUDAGraphDecodePrograms, PackedDecodePrograms, cuda_capture_plan, plan_sizes
from runner_core.errors import CompileError, ConfigError, EngineBusyError, InvalidRequestError, WorkerError
from runner_core.engine.forward_pass import ForwardPass
from runner_core.engine.input_buffers import InputBuffers
from runner_core.layers.attention import bind_kv_cache
from runner_core.layers.sampler import Sampler, SamplingMetadata
from runner_core.memory import FragmentationTracker, MemoryManager, plan_kv_pool
from runner_core.engine.output_processor import OutputProcessor
from runner_core.sampling_params import SamplingParams
from runner_core.engine.scheduler import Scheduler
from runner_core.engine.sequence import RequestOutput, Sequence
from runner_core.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("runner_core")
COMPILE_WARMUP_SIZES = [1, 16]  # 1 is specialised by dynamo; any other size runs the dynamic graph


@dataclass(slots=True)
class StepMetrics:
    """What one step did and how long its phases took (seconds)."""

    step: int
    time: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int
    num_preempted: int
    num_waiting: int
    num_running: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    total_s: float
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    kv_utilization: float
    internal_fragmentation: float
    static_reservation_waste: float  # what a max_model_len reservation per request would waste
    firstfit_reserved_waste: float  # a contiguous worst-case reservation per request ...
    firstfit_external_fragmentation: float  # ... and the holes between those reservations
    prefix_cache_hit_rate: float


class LLMEngine:
    def __init__(self, config: RunnerConfig, loaded, parallel=None):
        """`parallel`: the ParallelManager of a tensor/pipeline parallel runner (every rank builds
        this engine in step; rank 0 schedules and samples), or None in one process."""
        self.config = config
        self.parallel = parallel
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.vocab_size = self.hf_config.vocab_size
        self.max_model_len = self._resolve_max_model_len()
        bs = config.block_size
        num_layers = getattr(self.model, "num_layers", self.hf_config.num_hidden_layers)
        plan_config = self.hf_config
        if num_layers != self.hf_config.num_hidden_layers:  # a pipeline stage: its pool holds its layers
            plan_config = copy.copy(self.hf_config)
            plan_config.num_hidden_layers = num_layers
        self.pool_plan = plan_kv_pool(config, self.model, plan_config, self.max_model_len)
        if parallel is not None:  # one block count on every rank: rank 0's block tables are valid everywhere
            self.pool_plan = parallel.agree_pool_plan(self.pool_plan)
        self.bytes_per_token, num_blocks = self.pool_plan.bytes_per_token, self.pool_plan.num_blocks
        if num_blocks * bs < self.max_model_len:
            raise ConfigError(
                f"the KV pool holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}), fewer than one "
                f"max_model_len={self.max_model_len} sequence needs; raise kv_cache_memory to at least "
                f"{-(-self.max_model_len // bs) * bs * self.bytes_per_token} bytes or lower max_model_len")
        self.memory = MemoryManager(num_blocks, bs, config.enable_prefix_caching)
        self.fragmentation = FragmentationTracker(num_blocks * bs)
        self.last_fragmentation: dict = {}
        kv_cache = self.memory.allocate_kv_cache(num_layers, self.model.num_kv_heads,
                                                 self.model.head_dim, self.dtype, self.device)
        logger.info(self.pool_plan.describe())
        self.scheduler = Scheduler(self.memory, config.max_num_seqs, config.effective_max_num_batched_tokens)
        bind_kv_cache(self.model, kv_cache)
        buffers = InputBuffers(config.effective_max_num_batched_tokens, config.max_num_seqs,
                               self.memory.blocks_for(self.max_model_len), self.device)
        if parallel is None:
            self.forward_pass = ForwardPass(self.model, kv_cache, bs, self.device, buffers)
        else:
            self.forward_pass = parallel.make_forward_pass(self.model, kv_cache, bs, self.device, buffers)
        self.sampler = Sampler()
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.compiler: CompileOptimizer | None = None
        if config.compile and not config.enforce_eager:
            self.set_compile_mode(True)
        self.requests: dict[str, Sequence] = {}
        self.step_metrics: deque[StepMetrics] = deque(maxlen=4096)
        self._ids = itertools.count()
        self._num_steps = 0
        torch.manual_seed(config.seed)

    def _resolve_max_model_len(self) -> int:
        limit = self.hf_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ConfigError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}; "
                              f"use max_model_len <= {limit}")
        return wanted

    # ---- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; give at least one character or one token id")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one character or one token id")
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {prompt[bad]} at position {bad} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        return None, list(prompt)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError naming the problem."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (prompt and output "
                f"together); shorten the prompt or raise max_model_len")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        seq = Sequence(request_id, text, ids, len(ids), params, generator)
        if stream or params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self._release(seq)
        seq.finish("abort")
        return self.output_processor.output(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- compilation -----------------------------------------------------------------------
    def set_compile_mode(self, enabled: bool, *, backend: str | None = None, mode: str | None = None,
                         scope: str | None = None) -> dict:
        """Compile (or un-compile) the loaded model without reloading weights; warms up every
        compile size now. Refused while requests are in flight. A compile error falls back to
        eager with a warning unless `compile_fallback=False`."""
        if self.has_unfinished_requests():
            raise EngineBusyError("cannot change the compile mode while requests are running; "
                                  "wait for them to finish or abort them")
        if backend is not None:
            backend = RunnerConfig.coerce(self.config, compile_backend=backend).compile_backend
        if mode is not None:
            mode = RunnerConfig.coerce(self.config, compile_mode=mode).compile_mode
        if scope is not None:
            scope = RunnerConfig.coerce(self.config, compile_scope=scope).compile_scope
        optimizer = CompileOptimizer.create(self.config, self.hf_config, self.device, self.dtype, enabled=enabled,
                                            backend=backend, mode=mode, scope=scope)
        fp = self.forward_pass
        fp.decode_programs = None
        try:
            optimizer.apply(self.model)
            optimizer.warm_up(self._warm_up_run, COMPILE_WARMUP_SIZES)
            optimizer.finish_warm_up(*self._build_decode_programs(optimizer))
        except Exception as e:
            fp.decode_programs = None
            optimizer.reset(self.model)
            if not self.config.compile_fallback:
                raise CompileError(f"compiling with {optimizer.settings} failed: {type(e).__name__}: {e}") from e
            logger.warning("compiling with backend=%s mode=%s failed (%s: %s); running eager instead "
                           "(compile_fallback=False makes this an error)", optimizer.settings.backend,
                           optimizer.settings.mode, type(e).__name__, e)
            optimizer = CompileOptimizer.create(self.config, self.hf_config, self.device, self.dtype, enabled=False)
            optimizer.settings.reason = f"fell back to eager: {type(e).__name__}: {e}"
        self.compiler = optimizer
        return optimizer.stats()

    def _warm_up_run(self, num_tokens: int) -> None:
        self.forward_pass.run_dummy(num_tokens)

    def _build_decode_programs(self, optimizer: CompileOptimizer) -> tuple[object | None, str]:
        """Static programs for pure-decode batch sizes (decode_programs.py), installed on the
        forward pass; (programs or None, why)."""
        if not optimizer.settings.enabled:
            return None, "compilation is off"
        if self.parallel is not None:
            return None, "parallel ranks run the general program"
        fp = self.forward_pass
        if self.device.type == "cuda":
            sizes, _, why = cuda_capture_plan(self.config, self.hf_config, self.max_model_len,
                                              torch.cuda.mem_get_info(self.device)[1])
            if not sizes:
                return None, why
            self.memory.reset_prefix_cache()  # the capture's warm-up writes dummy K/V into block 0
            programs = CUDAGraphDecodePrograms(self.model, sizes, fp.buffers.max_blocks * self.memory.block_size)
        else:
            sizes, why = plan_sizes(self.config.compile_sizes, self.model, self.dtype, self.config.max_num_seqs,
                                    optimizer.route)
            if not sizes:
                return None, why
            programs = PackedDecodePrograms(self.model, sizes, optimizer)
        programs.build(fp.dummy_decode)
        if self.device.type == "cpu" and self.config.compile_sizes is None:  # the default: kept if it pays
            faster, measured = programs.pays_off(fp.dummy_decode)
            if not faster:
                programs.release()
                return None, f"device default [1] dropped: {measured}"
            why = f"{why}; {measured}"
        fp.decode_programs = programs
        return programs, why

    def compile_stats(self) -> dict:
        if self.compiler is None:
            return {"enabled": False, "backend": None, "mode": None, "scope": None, "cache": "off",
                    "compile_seconds": {}, "recompiles_after_warmup": 0, "graph_breaks": 0, "warm_start": None,
                    "cuda_graphs": cuda_graphs_status(self.device.type, "", False)}
        return self.compiler.stats()

    # ---- memory ----------------------------------------------------------------------------
    def defragment(self, shrink_to_blocks: int | None = None) -> dict:
        """Compact live and cached blocks to the lowest ids (between steps); optionally shrink the
        pool to `shrink_to_blocks`, releasing the memory beyond. Generations continue unchanged."""
        before = self.memory.num_blocks
        moved = self.memory.defragment(self.requests.values())
        if shrink_to_blocks is not None:
            occupied = self.memory.num_blocks - self.memory.num_free_blocks + self.memory.pool.num_cached_free
            floor = max(occupied, self.memory.blocks_for(self.max_model_len))
            if shrink_to_blocks < floor:
                raise InvalidRequestError(
                    f"cannot shrink the KV pool to {shrink_to_blocks} blocks: {occupied} are occupied and one "
                    f"max_model_len={self.max_model_len} sequence needs {self.memory.blocks_for(self.max_model_len)}; "
                    f"use at least {floor}")
            self.forward_pass.kv_cache = self.memory.shrink(shrink_to_blocks)
            bind_kv_cache(self.model, self.forward_pass.kv_cache)
            # the comparison allocators model the new capacity; live requests re-reserve next step
            self.fragmentation = FragmentationTracker(self.memory.num_blocks * self.memory.block_size)
        after = self.memory.num_blocks
        return {"blocks_moved": moved, "blocks_before": before, "blocks_after": after,
                "bytes_released": (before - after) * self.memory.block_size * self.bytes_per_token}

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward + sampling round. Returns outputs of streaming requests that
        advanced and of every request that finished."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        for seq, _ in sched.scheduled:  # idempotent: the contiguous comparison reserves once per request
            self.fragmentation.on_admit(seq.request_id,
                                        min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len))
        outputs = [self._fail(s, f"request needs {self.memory.blocks_for(s.num_tokens)} KV blocks but the "
                                 f"pool has {self.memory.num_blocks}; raise kv_cache_memory")
                   for s in sched.rejected]
        if sched.is_empty:
            return outputs
        t1 = time.perf_counter()
        inp = self.forward_pass.prepare(sched.scheduled)
        t2 = time.perf_counter()
        try:
            logits = self.forward_pass.execute(inp)
            t3 = time.perf_counter()
            seqs = inp.sampling_seqs
            sampled = None
            if seqs:
                meta = SamplingMetadata.build([s.params for s in seqs], [s.generator for s in seqs],
                                              self.vocab_size, self.device)
                sampled = self.sampler(logits, meta)
        except WorkerError:  # a parallel runner lost a worker: the runner is over, tell the caller
            raise
        except Exception as e:  # the batch is lost, not the engine
            logger.exception("step failed; failing the %d scheduled requests", len(sched.scheduled))
            return outputs + [self._fail(s, f"{type(e).__name__}: {e}") for s, _ in sched.scheduled]
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.memory.cache_blocks(seq)
        if sampled is not None:
            outputs += self._append_tokens(seqs, sampled)
        t4 = time.perf_counter()
        self._num_steps += 1
        mem = self.memory_figures()
        self.step_metrics.append(StepMetrics(
            self._num_steps, t4, len(sched.scheduled), inp.num_prefill_tokens, inp.num_decode_tokens,
            len(seqs), len(sched.preempted), len(self.scheduler.waiting), len(self.scheduler.running),
            t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0,
            mem["blocks_used"], mem["blocks_free"], mem["blocks_cached"], mem["kv_utilization"],
            mem["internal_fragmentation"], mem["static_reservation_waste"], mem["firstfit_reserved_waste"],
            mem["firstfit_external_fragmentation"], mem["prefix_cache_hit_rate"]))
        return outputs

    def memory_figures(self) -> dict:
        """The pool's block counts and utilization (physical blocks) with, for the same live
        requests, what a static reservation and a first-fit contiguous allocator would waste."""
        running = self.scheduler.running
        self.last_fragmentation = self.fragmentation.snapshot(
            [(s.request_id, s.num_computed_tokens, len(s.block_table)) for s in running],
            self.memory.block_size, self.max_model_len)
        figures = {k: v for k, v in self.last_fragmentation.items() if k.startswith(("static_", "firstfit_"))}
        return {**self.memory.stats(running), **figures}

    def _append_tokens(self, seqs: list[Sequence], sampled) -> list[RequestOutput]:
        outputs = []
        for seq, delta_ids, delta_text in self.output_processor.append(seqs, sampled):
            if seq.is_finished:
                self._release(seq)
            outputs.append(self.output_processor.output(seq, delta_ids, delta_text))
        return outputs

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.fragmentation.on_release(seq.request_id)
        self.requests.pop(seq.request_id, None)

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self._release(seq)
        seq.finish("error", error=message)
        return self.output_processor.output(seq, [], "")
