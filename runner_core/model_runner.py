"""ModelRunner: the façade of the seed's Appendix B — load, forward, generate, stream, memory figures."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass

import torch

from runner_core.config import RunnerConfig
from runner_core.engine.engine import LLMEngine
from runner_core.errors import EngineNotReadyError, InvalidRequestError
from runner_core.memory import check_config_fits
from runner_core.model_loader import ModelLoader
from runner_core.sampling_params import SamplingParams
from runner_core.engine.sequence import RequestOutput

logger = logging.getLogger("runner_core")


@dataclass
class StreamDelta:
    """A piece of a streamed generation: new text and token ids; the last one has `finished` set."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: RequestOutput

    def __str__(self) -> str:
        return self.text


class ModelRunner:
    def __init__(self, config: RunnerConfig | dict | None = None, **overrides):
        self.config = RunnerConfig.coerce(config, **overrides)
        self.engine: LLMEngine | None = None
        self.loaded = None
        self.parallel = None  # the ParallelManager when tensor_parallel_size x pipeline_parallel_size > 1

    # ---- lifecycle ------------------------------------------------------------------------
    def load_model(self) -> "ModelRunner":
        if self.config.world_size > 1:
            return self._load_parallel()
        self.memory_estimate = check_config_fits(self.config)  # refuse before reading any weight
        self.loaded = ModelLoader(self.config).load()
        self.engine = LLMEngine(self.config, self.loaded)
        return self

    def _load_parallel(self) -> "ModelRunner":
        """Start the ranks (spawned here, or this process's rank under torchrun) and build every
        rank's shard in step. Under torchrun, ranks > 0 serve rank 0 inside this call and exit
        the process when rank 0 shuts down."""
        from runner_core.model_loader import read_hf_config, resolve_model_path
        from runner_core.parallel.manager import ParallelManager
        from runner_core.parallel.plan import validate_parallel_config
        from runner_core.parallel.worker_proc import report_error, serve

        self.shutdown()
        config = self.config
        if config.pipeline_parallel_size > 1 and config.compile and config.compile_scope == "model":
            logger.warning("pipeline parallelism compiles each decoder layer (compile_scope='layer'): the stage "
                           "boundaries send and receive outside compiled graphs")
            config = config.replace(compile_scope="layer")
        stages = validate_parallel_config(config, read_hf_config(resolve_model_path(config.model),
                                                                 config.trust_remote_code))
        self.memory_estimate = check_config_fits(config)  # per device; before any process starts
        pm = ParallelManager.launch(config, stages)
        try:
            self.loaded, self.engine = pm.build_engine()
        except BaseException:
            if not pm.is_driver:
                report_error(pm, pm.rank)
            raise
        self.parallel = pm
        if not pm.is_driver:  # torchrun rank > 0
            try:
                serve(pm, self.engine)
            except BaseException:
                report_error(pm, pm.rank)
                raise
            pm.shutdown()
            raise SystemExit(0)
        return self

    def parallel_info(self) -> dict | None:
        """Ranks (pid, host, device, layers, weight and KV bytes), stage split and rank 0's
        communication figures of a parallel runner; None in one process."""
        return None if self.parallel is None else self.parallel.info()

    def shutdown(self) -> None:
        if self.parallel is not None:
            self.parallel.shutdown()
            self.parallel = None
        self.engine = None
        self.loaded = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
        return self._engine().model

    # ---- stateless forward ----------------------------------------------------------------
    def forward(self, input_ids, attention_mask: torch.Tensor | None = None) -> dict:
        """Full causal forward without the KV pool: {"logits": [B, T, V], "hidden_states": [B, T, H]}.

        Positions where `attention_mask` is 0 (left or right padding) are skipped and their
        outputs are zero."""
        engine = self._engine()
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequestError(f"input_ids must be a 2-D integer tensor [batch, tokens], got "
                                      f"shape {tuple(ids.shape)} dtype {ids.dtype}")
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else torch.as_tensor(attention_mask).bool()
        if mask.shape != ids.shape:
            raise InvalidRequestError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(ids.shape)}")
        ids, mask = ids.cpu(), mask.cpu()
        rows = [engine.encode_prompt(r[m].tolist())[1] for r, m in zip(ids, mask)]
        if max(map(len, rows)) > engine.max_model_len:
            raise InvalidRequestError(f"input has {max(map(len, rows))} tokens, more than max_model_len="
                                      f"{engine.max_model_len}")
        if self.parallel is not None:
            hidden, logits = self.parallel.forward_stateless(engine, rows)
        else:
            hidden = engine.forward_pass.run_stateless(rows)
            with torch.inference_mode():
                logits = engine.model.compute_logits(hidden)
        with torch.inference_mode():
            full_h = hidden.new_zeros(*ids.shape, hidden.shape[-1])
            full_l = logits.new_zeros(*ids.shape, logits.shape[-1])
            dev_mask = mask.to(hidden.device)
            full_h[dev_mask], full_l[dev_mask] = hidden, logits
        return {"logits": full_l, "hidden_states": full_h}

    # ---- engine-level API (used by the workbench session) ----------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False) -> str:
        return self._engine().add_request(prompt, params, request_id, stream).request_id

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
            raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {n} prompts; give one, or one per prompt")
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
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
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
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else pad
        width = max(map(len, full))
        return torch.tensor([f + [pad] * (width - len(f)) for f in full], dtype=torch.long)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, **kwargs) -> Iterator[StreamDelta]:
        """Yield text deltas of one request as they are produced (other queued requests advance too)."""
        engine = self._engine()
        (params,) = self._params(sampling_params, kwargs.pop("max_new_tokens", None), kwargs, 1)
        rid = engine.add_request(prompt, params, stream=True).request_id
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield StreamDelta(rid, out.delta_text, out.delta_token_ids, out.finished, out.finish_reason, out)
        finally:
            if not finished:
                engine.abort_request(rid)

    # ---- figures ----------------------------------------------------------------------------
    def memory_stats(self) -> dict:
        engine = self._engine()
        weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in engine.model.parameters()}.values())
        kv = engine.memory.kv_cache
        stats = {
            "device": str(engine.device),
            "weights_bytes": weights,
            "kv_pool_bytes": kv.numel() * kv.element_size(),
            "kv_bytes_per_token": engine.bytes_per_token,
            "activation_peak_bytes": engine.pool_plan.activation_peak_bytes,
            # CPU: the decode programs' prepacked weights; CUDA: their graphs' memory pool
            "decode_programs_bytes": getattr(engine.forward_pass.decode_programs, "memory_bytes", 0),
            "max_model_len": engine.max_model_len,
            **engine.memory_figures(),
        }
        if engine.device.type == "cuda":
            cuda = torch.cuda.memory_stats(engine.device)
            stats["cuda_reserved_bytes"] = cuda.get("reserved_bytes.all.current", 0)
            stats["cuda_allocated_bytes"] = cuda.get("allocated_bytes.all.current", 0)
        return stats

    def compile_model(self) -> dict:
        """Compile with the configured backend, mode and scope (Appendix A's `compile`)."""
        return self.set_compile_mode(True)

    def set_compile_mode(self, compile: bool = True, *, backend: str | None = None, mode: str | None = None,
                         scope: str | None = None) -> dict:
        """Switch compilation on a loaded runner (no weight reload); returns compile_stats()."""
        engine = self._engine()
        if self.parallel is not None:  # every rank compiles and warms up in step
            return self.parallel.set_compile_mode(engine, compile, backend=backend, mode=mode, scope=scope)
        return engine.set_compile_mode(compile, backend=backend, mode=mode, scope=scope)

    def compile_stats(self) -> dict:
        return self._engine().compile_stats()

    def defragment(self, shrink_to_blocks: int | None = None) -> dict:
        """Move live KV blocks to the lowest ids and optionally shrink the pool (see MemoryManager)."""
        if self.parallel is not None:  # every rank moves its KV shard the same way
            return self.parallel.defragment(self._engine(), shrink_to_blocks)
        return self._engine().defragment(shrink_to_blocks)

    def kv_block_map(self) -> dict:
        """Which request owns which KV block, and which free blocks still hold a cached prefix."""
        engine = self._engine()
        pool = engine.memory.pool
        return {
            "num_blocks": pool.num_blocks,
            "block_size": engine.memory.block_size,
            "owners": {rid: list(seq.block_table) for rid, seq in engine.requests.items() if seq.block_table},
            "cached_block_ids": [i for i in pool.free_queue if pool.blocks[i].block_hash is not None],
        }

    def reset_prefix_cache(self) -> int:
        return self._engine().memory.reset_prefix_cache()

    @property
    def step_metrics(self):
        return self._engine().step_metrics
