"""Memory management: the KV block pool, its sizing, memory prediction and fragmentation figures."""

from runner_core.memory.manager import MemoryManager
from runner_core.memory.sizing import available_memory_bytes, kv_bytes_per_token, plan_num_blocks

__all__ = ["MemoryManager", "available_memory_bytes", "kv_bytes_per_token", "plan_num_blocks"]
