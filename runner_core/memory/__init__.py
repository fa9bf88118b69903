"""MemoryManager: the KV block pool and everything the runner knows about memory.

* the pool: `manager.MemoryManager`, the one owner of the KV tensor (allocates it, binds each
  attention layer to its slice, moves and shrinks it), over `block_pool.BlockPool` (the blocks'
  reference counts, free queue and prefix-cache map);
* planning, before and at load: `shapes` (checkpoint shapes, per-device weights, the pipeline
  stage split), `estimate` (activation peak, `estimate_memory`), `fit` (refusals with what would
  fit), `sizing` (what a device offers, the pool plan), `profile` (a measured activation peak);
* diagnostics: `fragmentation` (the paged pool's waste against a static reservation and a
  first-fit contiguous allocator);
"""

from runner_core.memory.block_pool import BlockPool
from runner_core.memory.estimate import MemoryEstimate, estimate_activation_peak, estimate_memory
from runner_core.memory.fit import check_config_fits, check_fits
from runner_core.memory.fragmentation import FragmentationTracker
from runner_core.memory.manager import MemoryManager
from runner_core.memory.profile import dummy_batch, profile_activation_peak
from runner_core.memory.shapes import ModelShape, kv_bytes_per_token, stage_layer_ranges
from runner_core.memory.sizing import PoolPlan, available_memory_bytes, plan_kv_pool, plan_pool, usable_memory_bytes

__all__ = ["BlockPool", "FragmentationTracker", "MemoryEstimate", "MemoryManager", "ModelShape", "PoolPlan",
           "available_memory_bytes", "check_config_fits", "check_fits", "dummy_batch", "estimate_activation_peak",
           "estimate_memory", "kv_bytes_per_token", "plan_kv_pool", "plan_pool", "profile_activation_peak",
           "stage_layer_ranges", "usable_memory_bytes"]
