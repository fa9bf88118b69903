"""ModelRunner: the façade of the seed's Appendix B — load, forward, generate, stream, memory figures."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from runner_core.compile import cpu_programs_expected
from runner_core.config import RunnerConfig
from runner_core.engine import LLMEngine, LocalExecutor, RequestMetrics, RequestOutput, Worker
from runner_core.errors import ConfigError, EngineNotReadyError, InvalidRequestError
from runner_core.loader.checkpoint_writer import save_stored
from runner_core.loader.model_loader import ModelLoader, read_hf_config, resolve_model_path
from runner_core.memory import MemoryEstimate, check_config_fits
from runner_core.parallel.plan import validate_parallel_config
from runner_core.parallel.worker_proc import launch
from runner_core.process_memory import release_freed_memory
from runner_core.sampling_params import SamplingParams

logger = logging.getLogger("runner_core")


@dataclass(slots=True)
class StreamDelta:
    """A piece of a streamed generation: new text and token ids of completion `index` (0..n-1); the last one
    has `finished` set, `finish_reason` is its completion's."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: RequestOutput
    index: int = 0

    def __str__(self) -> str:
        return self.text


class ModelRunner:
    def __init__(self, config: RunnerConfig | dict | None = None, **overrides):
        """`config` (a RunnerConfig or its fields) with `overrides` (RunnerConfig fields) on top."""
        if "simulate" in overrides:
            raise ConfigError("ModelRunner takes no simulate=: a simulated runner is "
                              "runner_core.simulator.SimulatedRunner(config, simulate)")
        self.config = RunnerConfig.coerce(config, **overrides)
        self.engine: LLMEngine | None = None
        self.memory_estimate: MemoryEstimate | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def load_model(self) -> ModelRunner:
        """Load the model and build the engine. A configuration that cannot fit is refused before any
        weight is read (and a parallel layout the model does not allow, before any process starts).
        With tensor_parallel_size x pipeline_parallel_size > 1 the ranks are spawned here (or joined
        under torchrun, where ranks > 0 serve rank 0 inside this call and exit with it)."""
        self.shutdown()
        config = self.config
        stages = None
        if config.world_size > 1:
            hf_config = read_hf_config(resolve_model_path(config.model), config.trust_remote_code)
            stages = validate_parallel_config(config, hf_config)
        self.memory_estimate = check_config_fits(config, packed_decode_weights=cpu_programs_expected(config))
        if stages is not None:
            executor, loaded = launch(config, stages)
            worker = executor.worker
        else:
            loaded = ModelLoader(config).load()
            worker = Worker(config, loaded)
            executor = LocalExecutor(worker)
        self.engine = LLMEngine(config, loaded, worker, executor)
        return self

    def model_info(self) -> dict:
        """What was loaded and how: architecture, adapter path (`model_impl`: native or transformers)
        and kind, the model class and why it was chosen, parameters, dtype, device, max_model_len."""
        return dict(self._engine().model_info)

    def parallel_info(self) -> dict | None:
        """Ranks (pid, host, device, layers, weight and KV bytes), stage split and rank 0's
        communication figures of a parallel runner; None in one process."""
        return None if self.engine is None else self.engine.executor.info()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
        release_freed_memory()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise EngineNotReadyError("no model is loaded; call runner.load_model() first")
        return self.engine

    @property
    def tokenizer(self):
        return self._engine().tokenizer

    @property
    def model(self) -> torch.nn.Module:
        return self._engine().worker.model

    # ---- stateless forward ----------------------------------------------------------------
    def forward(self, input_ids, attention_mask: torch.Tensor | None = None, *,
                output_router_logits: bool = False) -> dict:
        """Full causal forward without the KV pool: {"logits": [B, T, V], "hidden_states": [B, T, H]}.

        Positions where `attention_mask` is 0 (left or right padding) are skipped and their
        outputs are zero. With `output_router_logits` (an MoE model, the seed's MoEAdapter) also
        "router_logits": a tuple with one [B, T, experts] tensor per MoE layer (the layers of
        `moe_stats()["layers"]`; `.reshape(-1, experts)` is transformers' per-layer tensor)."""
        engine = self._engine()
        if output_router_logits and not engine.worker.is_moe:
            info = engine.model_info
            raise InvalidRequestError(f"output_router_logits=True needs a mixture-of-experts model; "
                                      f"{info['architecture']} (kind {info['kind']!r}) has no router: call forward "
                                      "without it")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequestError(f"input_ids must be a 2-D integer tensor [batch, tokens], got "
                                      f"shape {tuple(ids.shape)} dtype {ids.dtype}")
        mask = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
                else torch.as_tensor(attention_mask).bool())
        if mask.shape != ids.shape:
            raise InvalidRequestError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids "
                                      f"{tuple(ids.shape)}")
        ids, mask = ids.cpu(), mask.cpu()
        rows = [engine.encode_prompt(r[m].tolist())[1] for r, m in zip(ids, mask)]
        if max(map(len, rows)) > engine.max_model_len:
            raise InvalidRequestError(f"input has {max(map(len, rows))} tokens, more than max_model_len="
                                      f"{engine.max_model_len}")
        hidden, logits, *router = engine.forward_stateless(rows, output_router_logits)
        with torch.inference_mode():
            full_h = hidden.new_zeros(*ids.shape, hidden.shape[-1])
            full_l = logits.new_zeros(*ids.shape, logits.shape[-1])
            dev_mask = mask.to(hidden.device)
            full_h[dev_mask], full_l[dev_mask] = hidden, logits
            out = {"logits": full_l, "hidden_states": full_h}
            if router:
                per_layer = []
                for layer in router[0]:
                    full = layer.new_zeros(*ids.shape, layer.shape[-1])
                    full[dev_mask] = layer
                    per_layer.append(full)
                out["router_logits"] = tuple(per_layer)
        return out

    # ---- engine-level API (used by the workbench session) ----------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False, metrics: RequestMetrics | None = None) -> str:
        """Queue a request; returns its id. `metrics`: a RequestMetrics the engine fills for it (its
        arrival_time the caller's), read live by the caller; the outputs' `metrics` dicts derive from it."""
        return self._engine().add_request(prompt, params, request_id, stream, metrics).request_id

    def step(self) -> list[RequestOutput]:
        return self._engine().step()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self._engine().abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self._engine().has_unfinished_requests()

    # ---- generation ---------------------------------------------------------------------
    @staticmethod
    def _params(sampling_params, max_new_tokens, kwargs, n) -> list[SamplingParams]:
        if max_new_tokens is not None:
            kwargs = {**kwargs, "max_tokens": max_new_tokens}
        if sampling_params is None:
            sampling_params = SamplingParams(**kwargs)
        elif kwargs:
            sampling_params = (sampling_params.replace(**kwargs) if isinstance(sampling_params, SamplingParams)
                               else [p.replace(**kwargs) for p in sampling_params])
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {n} prompts; give one, or "
                                      "one per prompt")
        return list(sampling_params)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 max_new_tokens: int | None = None, attention_mask: torch.Tensor | None = None, **kwargs):
        """Generate for one prompt or a batch.

        `prompts`: a str, a list of str, a list of token ids, a list of token-id lists, or a 2-D
        LongTensor (Appendix B). Returns a list of RequestOutput in prompt order; for a tensor,
        {"sequences": [B, T + new] LongTensor (right-padded with the pad id), "outputs": [...]}.
        A single bad prompt raises InvalidRequestError; in a batch, a bad prompt gets an output
        with finish_reason "error" and `error` set while the others complete.
        """
        engine = self._engine()
        as_tensor = isinstance(prompts, torch.Tensor)
        single = isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts
                                                          and isinstance(prompts[0], int))
        if as_tensor:
            items = self._tensor_rows(prompts, attention_mask)
        else:
            items = [prompts] if single else list(prompts)
        if not items:
            raise InvalidRequestError("no prompts given")
        params = self._params(sampling_params, max_new_tokens, kwargs, len(items))
        results: list[RequestOutput | None] = [None] * len(items)
        pending: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(items, params)):
            try:
                pending[engine.add_request(prompt, p).request_id] = i
            except InvalidRequestError as e:
                if single:
                    raise
                logger.warning("request %d refused: %s", i, e)
                results[i] = RequestOutput.failed("rejected", prompt, str(e))
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unanswered")
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        results[pending.pop(out.request_id)] = out
        finally:
            for rid in pending:
                engine.abort_request(rid)
        if as_tensor:
            return {"sequences": self._pad_sequences(items, results), "outputs": results}
        return results

    @staticmethod
    def _tensor_rows(ids: torch.Tensor, attention_mask) -> list[list[int]]:
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise InvalidRequestError(f"input_ids must be 2-D [batch, tokens], got shape {tuple(ids.shape)}")
        ids = ids.cpu()
        if attention_mask is None:
            return ids.tolist()
        mask = torch.as_tensor(attention_mask).bool().cpu()
        return [r[m].tolist() for r, m in zip(ids, mask)]

    def _pad_sequences(self, rows: list[list[int]], outs: list[RequestOutput]) -> torch.Tensor:
        full = [row + o.token_ids for row, o in zip(rows, outs)]
        tokenizer = self.tokenizer  # None: a model loaded without one
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        pad = 0 if pad is None else pad
        width = max(map(len, full))
        return torch.tensor([f + [pad] * (width - len(f)) for f in full], dtype=torch.long)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, **kwargs) -> Iterator[StreamDelta]:
        """Yield text deltas of one request as they are produced (other queued requests advance too); with n > 1
        each delta names its completion (`index`). best_of > n is refused: its n best are known only at the end."""
        engine = self._engine()
        (params,) = self._params(sampling_params, kwargs.pop("max_new_tokens", None), kwargs, 1)
        if params.num_sequences > params.n:
            raise InvalidRequestError(f"best_of={params.best_of} > n={params.n} cannot stream (the n best are known "
                                      "only at the end); use generate(), or best_of=None")
        rid = engine.add_request(prompt, params, stream=True).request_id
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        # the completions that advanced (one for n=1; the first when none did: an abort, an error)
                        done = [c for c in out.outputs if c.delta_token_ids or c.delta_text] or out.outputs[:1]
                        for c in done:
                            yield StreamDelta(request_id=rid, text=c.delta_text, token_ids=c.delta_token_ids,
                                              finished=out.finished and c is done[-1], finish_reason=c.finish_reason,
                                              output=out, index=c.index)
        finally:
            if not finished:
                engine.abort_request(rid)

    # ---- figures and operations ------------------------------------------------------------
    def save_pretrained(self, directory) -> Path:
        """Write the loaded model as it is stored (quantized or not) to `directory` as a checkpoint this
        project loads again: safetensors, config.json naming the format, the tokenizer's files."""
        engine = self._engine()
        if self.config.world_size > 1:
            raise ConfigError("save_pretrained saves a model loaded in one process; load it without tensor or "
                              "pipeline parallelism to save it")
        return save_stored(engine.worker.model, engine.hf_config, engine.model_info["quantization"],
                           Path(engine.model_info["model_path"]), directory)

    def memory_stats(self) -> dict:
        """Weights, KV pool, activation peak and decode-program bytes; blocks total/used/free/cached,
        KV utilization, internal fragmentation, prefix-cache hit rate; what a static reservation and
        a first-fit allocator would waste for the same requests; on CUDA torch's reserved/allocated."""
        return self._engine().memory_stats()

    def compile_model(self) -> dict:
        """Compile with the configured backend, mode and scope (Appendix A's `compile`)."""
        return self.set_compile_mode(True)

    def set_compile_mode(self, compile: bool = True, *, backend: str | None = None, mode: str | None = None,
                         scope: str | None = None) -> dict:
        """Switch compilation on a loaded runner (no weight reload); returns compile_stats()."""
        return self._engine().set_compile_mode(compile, backend=backend, mode=mode, scope=scope)

    def reconfigure(self, **fields) -> dict:
        """Change settings of the loaded runner without reloading a weight (a tuning sweep's step).
        Live: max_num_seqs, max_num_batched_tokens ("scheduler"); block_size, kv_cache_memory,
        gpu_memory_utilization, enable_prefix_caching rebuild the KV pool only ("pool": the prefix
        cache's contents are dropped); compile, compile_backend, compile_mode, compile_scope,
        enforce_eager switch the compile mode ("compile"). Other fields need a reload (ConfigError
        saying so); bad values raise ConfigError naming the field; EngineBusyError while requests run.
        Returns {"changed": {field: [old, new]}, "rebuilt": "none"|"scheduler"|"pool"|"compile",
        "seconds", "kv_tokens" (the pool's capacity after), "prefix_cache_dropped"}."""
        result = self._engine().reconfigure(**fields)
        self.config = self.engine.config
        return result

    def compile_stats(self) -> dict:
        return self._engine().compile_stats()

    def defragment(self, shrink_to_blocks: int | None = None) -> dict:
        """Move live KV blocks to the lowest ids and optionally shrink the pool (see MemoryManager)."""
        return self._engine().defragment(shrink_to_blocks)

    def kv_block_map(self) -> dict:
        """Which request owns which KV block, and which free blocks still hold a cached prefix."""
        return self._engine().kv_block_map()

    def moe_stats(self, recent_steps: int = 64) -> dict:
        """An MoE model's tokens per expert: {"layers": the MoE layers' global indices (the rows),
        "num_experts", "top_k", "steps", "cumulative": [layers][experts] since load, "recent":
        [layers][experts] over the last `recent_steps` steps, "recent_steps"}. Every engine step
        counts each scheduled token once per expert it picked (pad rows of decode programs never);
        each step's own counts are in `step_metrics[i].expert_counts`."""
        return self._engine().moe_stats(recent_steps)

    def reset_prefix_cache(self) -> int:
        return self._engine().memory.reset_prefix_cache()

    @property
    def step_metrics(self):
        return self._engine().step_metrics

    def record_step_detail(self, enabled: bool = True) -> None:
        """From the next step on, keep what each step did request by request and block by block in
        `step_details` (engine/step_detail.py: the requests run, admitted, preempted and for whom,
        finished; every KV block's holder after the step), bounded to the last steps whose block maps fit
        64 MiB. Off by default: a record costs a pass over the pool's blocks."""
        self._engine().record_step_detail(enabled)

    @property
    def step_details(self):
        """The recorded steps' StepDetail, oldest first; each has the `step` of its `step_metrics` record."""
        return self._engine().step_details

    def record_waste_per_step(self, enabled: bool = True) -> None:
        """From the next step on, every record in `step_metrics` also carries the KV waste figures of the
        requests running then (kv_utilization, internal_fragmentation, static_reservation_waste,
        firstfit_reserved_waste, firstfit_external_fragmentation; None while off). Off by default: they
        cost each step time in proportion to the requests running. `memory_stats()` gives the same
        figures, for now, either way."""
        self._engine().record_waste_per_step(enabled)
