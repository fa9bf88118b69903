"""Giving freed memory back to the operating system after a model is dropped.

Dropping the last reference frees torch's tensors, but the C allocator keeps freed heap pages for
reuse: without a trim, a process that unloaded a model still shows tens of MiB more resident memory
than before it loaded one. `release_freed_memory()` collects cycles, empties torch's CUDA cache and
asks glibc to return free heap pages (a no-op where the C library is not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from functools import cache

import torch


@cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None


def release_freed_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where that is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
