"""A speculative draft model's share of memory: its weights and the KV pool beside the target's.

The KV budget (kv_cache_memory, or what the device leaves) is split so that the target's pool and the draft's
hold the same number of tokens: blocks = budget // (block_size x (target's + draft's KV bytes per token)), the
draft's pool that many blocks of the same block_size. Its weights are counted before the pool is sized, like the
target's. `draft_share` gives the draft's figures from its config and checkpoint headers (estimate_memory, no
weight read); `draft_config` the RunnerConfig the draft is loaded under.
"""

from __future__ import annotations


def draft_model_of(config) -> str | None:
    """The draft model of a RunnerConfig's speculative_config, None without one."""
    spec = config.speculative_config
    return None if spec is None else spec.get("model")


def draft_share(config, max_model_len: int) -> tuple[int, int] | None:
    """(KV bytes per token, weight and buffer bytes) of `config`'s draft model in its compute dtype at
    `max_model_len` positions; None without a draft. A draft with fewer positions is refused (ConfigError)."""
    from runner_core.memory.estimate import estimate_memory

    model = draft_model_of(config)
    if model is None:
        return None
    est = estimate_memory(model, dtype=config.torch_dtype, max_model_len=max_model_len, kv_cache_memory=0,
                          device=str(config.torch_device), block_size=config.block_size, max_num_seqs=1,
                          trust_remote_code=config.trust_remote_code)
    return est.kv_bytes_per_token, est.weights_bytes + est.buffers_bytes


def draft_config(config, num_blocks: int, max_model_len: int):
    """The RunnerConfig the draft model loads under: the target's device, dtype and limits, no speculation,
    eager, no prefix cache, a KV pool of `num_blocks` blocks (the target's count)."""
    bytes_per_token = draft_share(config, max_model_len)[0]
    return config.replace(model=draft_model_of(config), speculative_config=None, compile=False,
                          enable_prefix_caching=False, max_model_len=max_model_len,
                          kv_cache_memory=num_blocks * config.block_size * bytes_per_token)
