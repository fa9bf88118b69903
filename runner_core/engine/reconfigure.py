"""A live change of a loaded runner's settings (`LLMEngine.reconfigure`): which RECONFIGURABLE group
each field is in, what a change rebuilds, the fields that need a reload refused, a pool too small for one
max_model_len sequence refused, and the change made on the engine and every rank (`reconfigure_engine`)."""

from __future__ import annotations

import time

from runner_core.config import RECONFIGURABLE, RunnerConfig
from runner_core.engine.spec_decode import SpecDecoder
from runner_core.errors import ConfigError

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
    spec = changed.get("speculative_config", [None, None])
    if any(value is not None and value.get("model") is not None for value in spec):
        raise ConfigError("config field 'speculative_config' cannot add, change or drop a draft model on a loaded "
                          "runner: its weights and KV pool load with the target; ModelRunner({..., "
                          "'speculative_config': ...}) and load_model() again")
    return new, changed, max((group_of(name) for name in changed), key=_REBUILDS.index, default="none")


def check_pool_fits(config: RunnerConfig, bytes_per_token: int, max_model_len: int) -> None:
    """Refuse a block size or KV budget whose pool holds less than one max_model_len sequence."""
    if config.kv_cache_memory is None:
        return
    bs = config.block_size
    tokens = config.kv_cache_memory // (bs * bytes_per_token) * bs
    if tokens < max_model_len:
        raise ConfigError(
            f"config field 'kv_cache_memory' got {config.kv_cache_memory!r}: with block_size={bs} the KV pool "
            f"holds {tokens} tokens, fewer than one max_model_len={max_model_len} sequence needs; allowed: "
            f"at least {-(-max_model_len // bs) * bs * bytes_per_token} bytes")


def reconfigure_engine(engine, fields: dict) -> dict:
    """Make the change of `fields` on an idle `engine` (LLMEngine.reconfigure says what it returns)."""
    start = time.perf_counter()
    new, changed, rebuilt = plan_reconfigure(engine.config, fields)
    result = {"changed": changed, "rebuilt": rebuilt, "prefix_cache_dropped": False}
    if changed:
        engine.check_idle("reconfigure the runner")
        if "block_size" in changed or "kv_cache_memory" in changed:
            check_pool_fits(new, engine.worker.pool_plan.bytes_per_token, engine.max_model_len)
        if "speculative_config" in changed:  # refused here, before any rank changes, for a model it cannot run
            spec = SpecDecoder.create(new, engine.max_model_len, engine.vocab_size,
                                      engine.worker.encoder_cache is not None)
        groups = tuple(sorted({group_of(name) for name in changed}))
        done = engine.executor.call("reconfigure", new, groups)
        if "compile" in groups:  # its own call: a parallel runner does not time a compile as a hang
            engine.executor.call("set_compile_mode", new.compile and not new.enforce_eager, new.compile_backend,
                                 new.compile_mode, new.compile_scope)
        if done["pool"] and rebuilt == "scheduler":
            result["rebuilt"] = "pool"  # the new limits plan a larger pool (or, on CUDA, a smaller one)
        engine.config, worker = new, engine.worker
        engine.memory = engine.scheduler.memory = engine.observer.memory = worker.memory
        engine.scheduler.max_num_seqs = new.max_num_seqs
        engine.scheduler.max_num_batched_tokens = new.effective_max_num_batched_tokens
        if "speculative_config" in changed:
            engine.spec = spec
        if worker.encoder_cache is not None:
            engine.scheduler.encoder_cached = worker.encoder_cache.__contains__
        if done["pool"]:
            engine.observer.on_pool_resized()
        result["prefix_cache_dropped"] = done["pool"]
    return {**result, "seconds": time.perf_counter() - start, "kv_tokens": engine.worker.pool_plan.num_tokens}
