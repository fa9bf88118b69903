"""LLMEngine: the step loop, on rank 0. Admits requests, schedules them, has the workers run the
model (through the executor's one `call` per step), samples, hands the sampled tokens to the
OutputProcessor and releases finished requests; the step's observer records what it did. One bad
request never stops it.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from runner_core.config import RECONFIGURABLE, RunnerConfig
from runner_core.engine.clock import WallClock
from runner_core.engine.input_batch import StepBatch
from runner_core.engine.input_processor import InputProcessor
from runner_core.engine.multimodal import MultiModalItem, MultiModalProcessor
from runner_core.engine.output_processor import OutputProcessor
from runner_core.engine.scheduler import Scheduler
from runner_core.engine.sequence import RequestMetrics, RequestOutput, Sequence
from runner_core.engine.step_metrics import StepObserver, StepTimes
from runner_core.engine.structured_output import StructuredOutputs
from runner_core.engine.threads import ThreadTuner
from runner_core.engine.worker import Executor, LocalExecutor, Worker
from runner_core.errors import ConfigError, EngineBusyError, InvalidRequestError, WorkerError
from runner_core.kernels import kernel_info
from runner_core.layers.sampler import Sampler, SamplingMetadata, nonfinite_rows
from runner_core.layers.weight_storage import num_weights
from runner_core.loader.model_loader import LoadedModel
from runner_core.loader.tokenizer import IncrementalDetokenizer
from runner_core.sampling_params import SamplingParams

logger = logging.getLogger("runner_core")

NONFINITE_MESSAGE = ("the model produced NaN or infinite logits for this request (at output token {n}); the request "
                     "was stopped, the others go on. Check the checkpoint's weights, or its dtype: float16 overflows "
                     "where bfloat16 or float32 do not")


class LLMEngine:
    def __init__(self, config: RunnerConfig, loaded: LoadedModel, worker: Worker, executor: Executor | None = None):
        """`worker`: this process's (rank 0's) worker, whose MemoryManager the scheduler hands blocks
        out of; `executor` runs worker methods on every rank (default: this process only)."""
        self._setup(config, worker, executor or LocalExecutor(worker), loaded.tokenizer, loaded.hf_config,
                    WallClock(), getattr(worker.model, "moe_spec", None))
        multimodal = None
        if loaded.processor is not None:
            multimodal = MultiModalProcessor(loaded.processor, worker.model.image_token_id,
                                             worker.model.tokens_per_image)
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, loaded.adapter.architecture, multimodal)
        adapter = loaded.adapter
        self.model_info = {
            "architecture": adapter.architecture, "model_impl": adapter.impl, "kind": adapter.kind,
            "model_class": adapter.model_class.__name__, "reason": adapter.reason, "model_path": str(loaded.model_path),
            "num_parameters": num_weights(worker.model), "weights_bytes": loaded.weight_bytes,
            "dtype": str(worker.dtype).removeprefix("torch."), "dtype_reason": _dtype_reason(config),
            "device": str(worker.device),
            "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
            # the native CPU kernels' instruction-set tier, why it was chosen, and the tiers this CPU runs
            "cpu_kernels": kernel_info() if worker.device.type == "cpu" else None,
            # how the weights are stored (None, int8, int4), what that kept in the compute dtype, the bytes saved
            "quantization": loaded.quantization}
        # the CPU threads of the steps: how many, why (explicit, or adapted to load: engine/threads.py)
        self.threads = ThreadTuner.for_engine(config.cpu_threads, worker.device, config.world_size)
        self.model_info["threads"] = self.threads.info()
        torch.manual_seed(config.seed)

    def _setup(self, config: RunnerConfig, worker, executor: Executor, tokenizer, hf_config, clock,
               moe_spec) -> None:
        """The state every engine has, a simulated one too (runner_core/simulator): the scheduler over the
        worker's MemoryManager, the sampler, the output processor and the step observer, all on `clock`."""
        self.config, self.worker, self.executor, self.clock = config, worker, executor, clock
        self.tokenizer, self.hf_config = tokenizer, hf_config
        self.device, self.vocab_size, self.max_model_len = worker.device, worker.vocab_size, worker.max_model_len
        self.memory = worker.memory
        cache = worker.encoder_cache
        self.scheduler = Scheduler(self.memory, config.max_num_seqs, config.effective_max_num_batched_tokens,
                                   encoder_cached=cache.__contains__ if cache is not None else lambda digest: False,
                                   clock=clock)
        self.sampler = Sampler()
        self.structured = StructuredOutputs(tokenizer, self.vocab_size)
        self.output_processor = OutputProcessor(tokenizer, self.max_model_len, clock)
        self.observer = StepObserver(self.memory, self.scheduler, self.max_model_len, moe_spec=moe_spec, clock=clock)
        self.requests: dict[str, Sequence] = {}
        self._freed: list[str] = []  # requests freed since the last batch: their block-table rows go on every rank
        self._ids = itertools.count()

    @property
    def step_metrics(self):
        """The bounded deque of StepMetrics records, oldest first."""
        return self.observer.records

    # ---- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> tuple[str | None, list[int], list[MultiModalItem]]:
        """(text or None, token ids, images) of any accepted prompt form (engine/input_processor.py)."""
        return self.inputs.encode(prompt)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False, metrics: RequestMetrics | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError naming the problem. `metrics`: the
        request's timing record to fill, with the caller's arrival time (default: a new one arriving now)."""
        metrics = RequestMetrics(self.clock.now()) if metrics is None else metrics
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids, images = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (prompt and output "
                f"together); shorten the prompt or raise max_model_len")
        budget = self.scheduler.max_num_batched_tokens
        big = next((i for i, m in enumerate(images) if m.length > budget), None)
        if big is not None:
            raise InvalidRequestError(f"image {big} fills {images[big].length} tokens but max_num_batched_tokens is "
                                      f"{budget} (an image's tokens run in one step); raise max_num_batched_tokens "
                                      f"to at least {images[big].length}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:  # compiled (or cached) now: a bad one is refused here
            self.structured.add(request_id, params.structured_outputs)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        metrics.num_prompt_tokens = len(ids)
        seq = Sequence(request_id=request_id, prompt=text, token_ids=ids, num_prompt_tokens=len(ids), params=params,
                       generator=generator, mm_items=tuple(images), metrics=metrics)
        if stream or params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has no context
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self._release(seq)
        seq.finish("abort", self.clock.now())
        return self.output_processor.output(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise EngineBusyError(f"cannot {what} while requests are running; wait for them to finish or abort them")

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward + sampling round. Returns outputs of streaming requests that
        advanced and of every request that finished."""
        clock = self.clock
        start = clock.now()
        sched = self.scheduler.schedule()
        outputs = [self._fail(s, f"request needs {self.memory.blocks_for(s.num_tokens)} KV blocks but the "
                                 f"pool has {self.memory.num_blocks}; raise kv_cache_memory")
                   for s in sched.rejected]
        if sched.is_empty:
            return outputs
        self.threads.before_step()
        freed, self._freed = self._freed + [s.request_id for s in sched.preempted], []
        batch, ordered = StepBatch.build(sched.scheduled, freed)
        seqs = [ordered[i] for i in batch.sample_rows]
        scheduled = clock.now()
        try:
            sampled, broken, prepare_s, expert_counts, executed = self._run_model(batch, seqs)
        except BaseException as e:
            self._freed[:0] = freed  # a rank may not have taken them: they go again with the next batch
            # a parallel runner lost a worker (the runner is over, tell the caller), or an interrupt
            if isinstance(e, WorkerError) or not isinstance(e, Exception):
                raise
            # the batch is lost, not the engine
            logger.exception("step failed; failing the %d scheduled requests", len(sched.scheduled))
            return outputs + [self._fail(s, f"{type(e).__name__}: {e}") for s, _ in sched.scheduled]
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            seq.num_sent_blocks = len(seq.block_table)  # every rank took the batch's entries
            self.memory.cache_blocks(seq)
        if broken:  # those requests fail; the rest of the batch goes on
            outputs += [self._fail(seqs[i], NONFINITE_MESSAGE.format(n=seqs[i].num_output_tokens)) for i in broken]
            seqs, sampled = _without(seqs, sampled, broken)
        if sampled is not None:
            outputs += self._append_tokens(seqs, sampled)
        num_finished = sum(o.finished for o in outputs)  # a request's final output comes once
        end = clock.now()
        if self.threads.after_step(len(batch.token_ids), batch.num_prefill_tokens > 0, end - start):
            self.model_info["threads"] = self.threads.info()
        self.observer.on_step(sched, batch, len(seqs), num_finished,
                              StepTimes(start=start, scheduled=scheduled, executed=executed, end=end,
                                        prepare_s=prepare_s), expert_counts, self.requests)
        return outputs

    def _run_model(self, batch: StepBatch, seqs: list[Sequence]):
        """Run the model on `batch` on every rank and sample a token for `seqs` (the batch's sampling rows):
        (the SamplerOutput or None, rows whose logits were not finite, seconds preparing inputs, the MoE
        expert counts or None, the clock when the model had run). A simulated engine replaces this."""
        constrained = self.structured.constrained_rows(seqs)
        masks = self.structured.start_fill(seqs, constrained) if constrained else None  # while the model runs
        logits, prepare_s, expert_counts = self.executor.call("execute_model", batch)
        executed = self.clock.now()
        if batch.prompt_logits:  # the rows after the sampling ones: prompt positions
            spans = [(self.requests[batch.request_ids[r]], p, c) for r, p, c in batch.prompt_logits]
            self.output_processor.add_prompt_logprobs(spans, logits[len(seqs):])
            logits = logits[:len(seqs)]
        sampled, broken = None, []
        if seqs:
            logits, broken = nonfinite_rows(logits)
            if masks is not None:
                logits = self.structured.apply(logits, constrained, masks)
            meta = SamplingMetadata.build([s.params for s in seqs], [s.generator for s in seqs],
                                          self.vocab_size, self.device)
            sampled = self.sampler(logits, meta)
        return sampled, broken, prepare_s, expert_counts, executed

    def _append_tokens(self, seqs: list[Sequence], sampled) -> list[RequestOutput]:
        errors = self.structured.advance(seqs, sampled.sampled_token_ids) if self.structured.has_matchers else {}
        outputs = [self._fail(seqs[i], message) for i, message in errors.items()]  # the grammar refused the token
        seqs, sampled = _without(seqs, sampled, list(errors))
        for seq, delta_ids, delta_text in self.output_processor.append(seqs, sampled) if sampled is not None else ():
            if seq.is_finished:
                self._release(seq)
            outputs.append(self.output_processor.output(seq, delta_ids, delta_text))
        return outputs

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._freed.append(seq.request_id)
        self.observer.on_release(seq.request_id)
        self.structured.release(seq.request_id)
        self.requests.pop(seq.request_id, None)

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self._release(seq)
        seq.finish("error", self.clock.now(), error=message)
        return self.output_processor.output(seq, [], "")

    # ---- operations on every rank -----------------------------------------------------------
    def forward_stateless(self, rows: list[list[int]], output_router_logits: bool = False) -> tuple[torch.Tensor, ...]:
        """(hidden [N, H], logits [N, V]) of a causal forward of independent rows without the KV pool
        (and the router logits [MoE layers, N, experts] with `output_router_logits`)."""
        return self.executor.call("run_stateless", rows, output_router_logits)

    def set_compile_mode(self, enabled: bool, *, backend: str | None = None, mode: str | None = None,
                         scope: str | None = None) -> dict:
        """Compile (or un-compile) on every rank without reloading weights; refused while requests
        are in flight. Options are validated here first (ConfigError naming the field)."""
        self._check_idle("change the compile mode")
        options = {"compile_backend": backend, "compile_mode": mode, "compile_scope": scope}
        RunnerConfig.coerce(self.config, **{k: v for k, v in options.items() if v is not None})
        return self.executor.call("set_compile_mode", enabled, backend, mode, scope)

    def reconfigure(self, **fields) -> dict:
        """Change RECONFIGURABLE fields without reloading a weight, on every rank (`Worker.reconfigure`);
        refused while requests run. Returns {"changed": {field: [old, new]}, "rebuilt": "none",
        "scheduler", "pool" or "compile" (the largest part rebuilt), "seconds", "kv_tokens"}; a pool
        rebuild drops the prefix cache's contents ("prefix_cache_dropped")."""
        start = time.perf_counter()
        new, changed, rebuilt = plan_reconfigure(self.config, fields)
        result = {"changed": changed, "rebuilt": rebuilt, "prefix_cache_dropped": False}
        if changed:
            self._check_idle("reconfigure the runner")
            if "block_size" in changed or "kv_cache_memory" in changed:
                self._check_pool_fits(new)
            groups = tuple(sorted({group_of(name) for name in changed}))
            done = self.executor.call("reconfigure", new, groups)
            if "compile" in groups:  # its own call: a parallel runner does not time a compile as a hang
                self.executor.call("set_compile_mode", new.compile and not new.enforce_eager, new.compile_backend,
                                   new.compile_mode, new.compile_scope)
            if done["pool"] and rebuilt == "scheduler":
                result["rebuilt"] = "pool"  # the new limits plan a larger pool (or, on CUDA, a smaller one)
            self.config, worker = new, self.worker
            self.memory = self.scheduler.memory = self.observer.memory = worker.memory
            self.scheduler.max_num_seqs = new.max_num_seqs
            self.scheduler.max_num_batched_tokens = new.effective_max_num_batched_tokens
            if worker.encoder_cache is not None:
                self.scheduler.encoder_cached = worker.encoder_cache.__contains__
            if done["pool"]:
                self.observer.on_pool_resized()
            result["prefix_cache_dropped"] = done["pool"]
        return {**result, "seconds": time.perf_counter() - start, "kv_tokens": self.worker.pool_plan.num_tokens}

    def _check_pool_fits(self, config: RunnerConfig) -> None:
        """Refuse a block size or KV budget whose pool holds less than one max_model_len sequence."""
        if config.kv_cache_memory is None:
            return
        bs, per_token = config.block_size, self.worker.pool_plan.bytes_per_token
        tokens = config.kv_cache_memory // (bs * per_token) * bs
        if tokens < self.max_model_len:
            raise ConfigError(
                f"config field 'kv_cache_memory' got {config.kv_cache_memory!r}: with block_size={bs} the KV pool "
                f"holds {tokens} tokens, fewer than one max_model_len={self.max_model_len} sequence needs; allowed: "
                f"at least {-(-self.max_model_len // bs) * bs * per_token} bytes")

    def compile_stats(self) -> dict:
        return self.worker.compile_stats()

    def defragment(self, shrink_to_blocks: int | None = None) -> dict:
        """Compact live and cached blocks to the lowest ids (between steps) on every rank; optionally
        shrink the pool to `shrink_to_blocks`, releasing the memory beyond. Generations continue
        unchanged."""
        memory, before = self.memory, self.memory.num_blocks
        if shrink_to_blocks is not None:
            floor = max(memory.num_occupied_blocks, memory.blocks_for(self.max_model_len))
            if shrink_to_blocks < floor:
                raise InvalidRequestError(
                    f"cannot shrink the KV pool to {shrink_to_blocks} blocks: {memory.num_occupied_blocks} are "
                    f"occupied and one max_model_len={self.max_model_len} sequence needs "
                    f"{memory.blocks_for(self.max_model_len)}; use at least {floor}")
        moves = memory.compact(self.requests.values())
        after = before if shrink_to_blocks is None else min(before, shrink_to_blocks)
        if moves or after < before:
            self.executor.call("move_kv_blocks", moves, after)
        if after < before:
            self.observer.on_pool_resized()
        return {"blocks_moved": len(moves), "blocks_before": before, "blocks_after": after,
                "bytes_released": (before - after) * memory.block_size * self.worker.pool_plan.bytes_per_token}

    # ---- figures ----------------------------------------------------------------------------
    def memory_stats(self) -> dict:
        stats = {"device": str(self.device), **self.worker.memory_bytes(), "max_model_len": self.max_model_len,
                 **self.observer.memory_figures()}
        if self.device.type == "cuda":
            cuda = torch.cuda.memory_stats(self.device)
            stats["cuda_reserved_bytes"] = cuda.get("reserved_bytes.all.current", 0)
            stats["cuda_allocated_bytes"] = cuda.get("allocated_bytes.all.current", 0)
        return stats

    def record_waste_per_step(self, enabled: bool = True) -> None:
        """Put the KV waste figures in every step's record from the next step on (StepObserver.waste_per_step)."""
        self.observer.waste_per_step = enabled

    def record_step_detail(self, enabled: bool = True) -> None:
        """Keep what each step did, request by request and block by block (engine/step_detail.py)."""
        self.observer.record_step_detail(enabled)

    @property
    def step_details(self):
        """The recorded steps' details, oldest first (empty unless `record_step_detail()` is on)."""
        return self.observer.detail.records if self.observer.detail is not None else ()

    def moe_stats(self, recent_steps: int = 64) -> dict:
        """Tokens routed to each expert of each MoE layer (StepObserver.moe_stats)."""
        return self.observer.moe_stats(recent_steps)

    def kv_block_map(self) -> dict:
        """Which request owns which KV block, and which free blocks still hold a cached prefix."""
        pool = self.memory.pool  # each request's blocks in its table's order (a step detail keeps only holders)
        return {"num_blocks": pool.num_blocks, "block_size": self.memory.block_size,
                "owners": {rid: list(seq.block_table) for rid, seq in self.requests.items() if seq.block_table},
                "cached_block_ids": [i for i in pool.free_queue if pool.blocks[i].block_hash is not None]}

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.threads.close()
        self.structured.close()


def _without(seqs: list[Sequence], sampled, rows: list[int]):
    """(the sequences, the SamplerOutput) without these rows; the output None when no row is left."""
    if not rows:
        return seqs, sampled
    keep = [i for i in range(len(seqs)) if i not in set(rows)]
    return [seqs[i] for i in keep], sampled.select(keep) if keep else None


_REBUILDS = ("none", "scheduler", "pool", "compile")  # what a change rebuilds, least to most


def group_of(field: str) -> str | None:
    """The RECONFIGURABLE group of a config field, None for one that needs a reload."""
    return next((group for group, names in RECONFIGURABLE.items() if field in names), None)


def plan_reconfigure(config: RunnerConfig, fields: dict) -> tuple[RunnerConfig, dict, str]:
    """(the new validated config, the changed fields {name: [old, new]}, what they rebuild) for a live
    change of `fields`. A field that needs a reload is refused unless its value stays the same."""
    new = config.replace(**fields)  # unknown fields and bad values: ConfigError naming them
    changed = {name: [getattr(config, name), getattr(new, name)] for name in fields
               if getattr(config, name) != getattr(new, name)}
    reload = [name for name in changed if group_of(name) is None]
    if reload:
        given = ", ".join(f"{name!r}: {fields[name]!r}" for name in reload)
        live = ", ".join(name for names in RECONFIGURABLE.values() for name in names)
        raise ConfigError(f"config field {reload[0]!r} cannot change on a loaded runner: it needs a reload: "
                          f"ModelRunner({{..., {given}}}) and load_model() again. Fields that change live: {live}")
    return new, changed, max((group_of(name) for name in changed), key=_REBUILDS.index, default="none")


def _dtype_reason(config: RunnerConfig) -> str:
    return f"auto: {config.auto_dtype()[1]}" if config.dtype == "auto" else "set in the config"
