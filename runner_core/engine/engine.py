"""LLMEngine: the step loop, on rank 0. Admits requests, schedules them, has the workers run the
model (through the executor's one `call` per step), samples (forking a parallel-sampling request's
prompt into its sequences: engine/parallel_sampling.py), hands the sampled tokens to the OutputProcessor
and releases finished requests; the step's observer records what it did. One bad request never stops it.
"""

from __future__ import annotations

import itertools
import logging

import torch

from runner_core.config import RunnerConfig
from runner_core.engine.clock import WallClock
from runner_core.engine.input_batch import StepBatch
from runner_core.engine.input_processor import InputProcessor
from runner_core.engine.multimodal import MultiModalItem, MultiModalProcessor
from runner_core.engine.output_processor import OutputProcessor
from runner_core.engine.parallel_sampling import ParentRequest, check_parallel_sampling, expand_forks
from runner_core.engine.reconfigure import reconfigure_engine
from runner_core.engine.scheduler import Scheduler
from runner_core.engine.sequence import RequestMetrics, RequestOutput, Sequence
from runner_core.engine.spec_decode import SpecDecoder
from runner_core.engine.step_metrics import StepObserver, StepTimes
from runner_core.engine.structured_output import StructuredOutputs
from runner_core.engine.threads import ThreadTuner
from runner_core.engine.worker import Executor, LocalExecutor, Worker
from runner_core.errors import EngineBusyError, InvalidRequestError, WorkerError
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
        self.spec = SpecDecoder.create(config, self.max_model_len, self.vocab_size, cache is not None, worker,
                                       tokenizer)  # None: off
        self.requests: dict[str, Sequence] = {}  # every sequence, a parallel-sampling request's children too
        self.groups: dict[str, ParentRequest] = {}  # the requests with n or best_of > 1, until their final output
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
        if request_id in self.requests or request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_parallel_sampling(params, request_id, self.scheduler.max_num_seqs)
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
        if params.num_sequences > 1:
            self.groups[request_id] = ParentRequest(seq, stream)
        if seq.params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has no context
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id in self.groups:
            return self._end_group(self.groups[request_id], "abort")
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self._release(seq)
        seq.finish("abort", self.clock.now())
        return self.output_processor.output(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise EngineBusyError(f"cannot {what} while requests are running; wait for them to finish or abort them")

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward + sampling round. Returns outputs of streaming requests that
        advanced and of every request that finished."""
        clock = self.clock
        start = clock.now()
        if self.spec is not None:  # drafts for the running decodes (engine/spec_decode.py)
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        outputs = _present(self._fail(s, f"request needs {self.memory.blocks_for(s.num_tokens)} KV blocks but "
                                         f"the pool has {self.memory.num_blocks}; raise kv_cache_memory")
                           for s in sched.rejected)
        if sched.is_empty:
            return outputs
        self.threads.before_step()
        freed, self._freed = self._freed + [s.request_id for s in sched.preempted], []
        batch, ordered = StepBatch.build(sched.scheduled, freed, self.memory.take_copies(), self.spec is not None)
        seqs = expand_forks([ordered[i] for i in batch.sample_rows], self._fork)
        scheduled = clock.now()
        try:
            sampled, broken, prepare_s, expert_counts, executed = self._run_model(batch, seqs, ordered)
        except BaseException as e:
            self._freed[:0] = freed  # a rank may not have taken them: they go again with the next batch
            # a parallel runner lost a worker (the runner is over, tell the caller), or an interrupt
            if isinstance(e, WorkerError) or not isinstance(e, Exception):
                raise
            # the batch is lost, not the engine
            logger.exception("step failed; failing the %d scheduled requests", len(sched.scheduled))
            return outputs + _present(self._fail(s, f"{type(e).__name__}: {e}") for s, _ in sched.scheduled)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n - len(seq.spec_token_ids)  # drafts count once accepted (SpecDecoder.settle)
            seq.num_sent_blocks = len(seq.block_table)  # every rank took the batch's entries
            self.memory.cache_blocks(seq)
        if broken:  # those requests fail; the rest of the batch goes on
            outputs += _present(self._fail(seqs[i], NONFINITE_MESSAGE.format(n=seqs[i].num_output_tokens))
                                for i in broken)
            seqs, sampled = _without_finished(seqs, sampled)
        if sampled is not None:
            outputs += self._append_tokens(seqs, sampled)
        if batch.spec_rows:
            self.spec.settle(self.memory)
        num_finished = sum(o.finished for o in outputs)  # a request's final output comes once
        end = clock.now()
        if self.threads.after_step(len(batch.token_ids), batch.num_prefill_tokens > 0, end - start):
            self.model_info["threads"] = self.threads.info()
        self.observer.on_step(sched, batch, len(seqs), num_finished,
                              StepTimes(start=start, scheduled=scheduled, executed=executed, end=end,
                                        prepare_s=prepare_s), expert_counts, self.requests,
                              self.spec.take_step_stats() if batch.spec_rows else None)
        return outputs

    def _run_model(self, batch: StepBatch, seqs: list[Sequence], ordered: list[Sequence]):
        """Run the model on `batch` (its sequences `ordered`) on every rank and sample a token for `seqs` (the
        batch's sampling rows), verifying drafts where the batch has them: (the SamplerOutput or None, rows whose
        logits were not finite, seconds preparing inputs, the MoE expert counts or None, the clock when the
        model had run). A simulated engine replaces this."""
        constrained = self.structured.constrained_rows(seqs)
        masks = self.structured.start_fill(seqs, constrained) if constrained else None  # while the model runs
        logits, prepare_s, expert_counts = self.executor.call("execute_model", batch)
        executed = self.clock.now()
        num_drafts = batch.num_spec_tokens
        if batch.prompt_logits:  # the rows after the sampling ones (and the drafts'): prompt positions
            spans = [(self.requests[batch.request_ids[r]], p, c) for r, p, c in batch.prompt_logits]
            self.output_processor.add_prompt_logprobs(spans, logits[len(seqs) + num_drafts:])
            logits = logits[:len(seqs) + num_drafts]
        if num_drafts:
            logits, draft_logits = logits[:len(seqs)], logits[len(seqs):]
        sampled, broken = None, []
        if seqs:
            logits, broken = nonfinite_rows(logits)
            if masks is not None:
                logits = self.structured.apply(logits, constrained, masks)
            meta = SamplingMetadata.build([s.params for s in seqs], [s.generator for s in seqs],
                                          self.vocab_size, self.device)
            sampled = self.sampler(logits, meta)
            if num_drafts:
                sampled = self.spec.verify(seqs, sampled, draft_logits, [ordered[r] for r, _ in batch.spec_rows])
        return sampled, broken, prepare_s, expert_counts, executed

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Fork `parent` as the step that completes its prompt samples; its new children run from now on."""
        children = parent.group.fork(self.memory)
        self.scheduler.fork(parent, children)
        for child in children:
            self.requests[child.request_id] = child
            if child.params.structured_outputs is not None:  # each its own matcher
                self.structured.add(child.request_id, child.params.structured_outputs)
        return children

    def _append_tokens(self, seqs: list[Sequence], sampled) -> list[RequestOutput]:
        errors = self.structured.advance(seqs, sampled.sampled_token_ids) if self.structured.has_matchers else {}
        outputs = _present(self._fail(seqs[i], message) for i, message in errors.items())  # the grammar refused it
        seqs, sampled = _without_finished(seqs, sampled)
        groups: dict[int, list] = {}  # a group's updates, for its one output of the step
        for seq, delta_ids, delta_text in self.output_processor.append(seqs, sampled) if sampled is not None else ():
            if seq.is_finished:
                self._release(seq)
            if seq.group is None:
                outputs.append(self.output_processor.output(seq, delta_ids, delta_text))
            else:
                groups.setdefault(id(seq.group), []).append((seq, delta_ids, delta_text))
        return outputs + _present(u[0][0].group.output(u, self.output_processor, self.clock.now())
                                  for u in groups.values())

    def _end_group(self, group: ParentRequest, reason: str, error: str | None = None) -> RequestOutput | None:
        """End every sequence of `group` (abort, or a member failed): its final output, None if it was made."""
        for seq in group.live():
            seq.finish(reason, self.clock.now(), error=error)
            self._release(seq)
        return group.output([], self.output_processor, self.clock.now())

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._freed.append(seq.request_id)
        self.observer.on_release(seq.request_id)
        if self.spec is not None:
            self.spec.release(seq.request_id)
        self.structured.release(seq.request_id)
        self.requests.pop(seq.request_id, None)
        if seq.group is not None and not seq.group.live():  # its request's last sequence
            self.groups.pop(seq.group.request_id, None)

    def _fail(self, seq: Sequence, message: str) -> RequestOutput | None:
        if seq.group is not None:
            return self._end_group(seq.group, "error", message)
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
        self.check_idle("change the compile mode")
        options = {"compile_backend": backend, "compile_mode": mode, "compile_scope": scope}
        RunnerConfig.coerce(self.config, **{k: v for k, v in options.items() if v is not None})
        return self.executor.call("set_compile_mode", enabled, backend, mode, scope)

    def reconfigure(self, **fields) -> dict:
        """Change RECONFIGURABLE fields without reloading a weight, on every rank (`Worker.reconfigure`);
        refused while requests run. Returns {"changed": {field: [old, new]}, "rebuilt": "none",
        "scheduler", "pool" or "compile" (the largest part rebuilt), "seconds", "kv_tokens"}; a pool
        rebuild drops the prefix cache's contents ("prefix_cache_dropped"): engine/reconfigure.py."""
        return reconfigure_engine(self, fields)

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
        if self.spec is not None:  # speculation's settings and figures since load (spec_decode/metrics.py)
            stats["spec_decoding"] = self.spec.stats()
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
        """Which request owns which KV block, which blocks several share, which free ones hold a cached prefix."""
        return self.memory.block_map(self.requests)

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.threads.close()
        self.structured.close()


def _without_finished(seqs: list[Sequence], sampled):
    """(the sequences, the SamplerOutput) without the rows of finished sequences (failed: a whole group fails
    with one); the output None when no row is left."""
    keep = [i for i, s in enumerate(seqs) if not s.is_finished]
    if len(keep) == len(seqs):
        return seqs, sampled
    return [seqs[i] for i in keep], sampled.select(keep) if keep else None


def _present(outputs) -> list[RequestOutput]:
    """The outputs made (a group's failure makes its one final output, for the first of its sequences)."""
    return [o for o in outputs if o is not None]


def _dtype_reason(config: RunnerConfig) -> str:
    return f"auto: {config.auto_dtype()[1]}" if config.dtype == "auto" else "set in the config"
