"""Memory management: the KV block pool, its sizing, memory prediction and fragmentation figures."""

from runner_core.memory.fragmentation import FragmentationTracker
from runner_core.memory.manager import MemoryManager
from runner_core.memory.sizing import available_memory_bytes, kv_bytes_per_token

__all__ = ["FragmentationTracker", "MemoryManager", "available_memory_bytes", "kv_bytes_per_token"]
from runner_core.memory.estimate import MemoryEstimate, estimate_memory  # noqa: E402
from runner_core.memory.fit import check_config_fits, check_fits  # noqa: E402
from runner_core.memory.profile import profile_activation_peak  # noqa: E402
from runner_core.memory.sizing import PoolPlan, plan_kv_pool, plan_pool, usable_memory_bytes  # noqa: E402

__all__ += ["MemoryEstimate", "PoolPlan", "check_config_fits", "check_fits", "estimate_memory", "plan_kv_pool",
            "plan_pool", "profile_activation_peak", "usable_memory_bytes"]
