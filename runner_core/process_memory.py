"""Giving freed memory back to the operating system after a model is dropped.

Dropping the last reference frees torch's tensors, but the C allocator keeps freed heap pages for
reuse: without a trim, a process that unloaded a model still shows tens of MiB more resident memory
than before it loaded one. `release_freed_memory()` collects cycles, empties torch's CUDA cache and
asks glibc to return free heap pages (a no-op where the C library is not glibc). The figures of
what the process holds (`resident_bytes`, `process_memory`) live here too.
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
    trim_heap()


def trim_heap() -> None:
    """Return the C heap's free pages to the system (what a load's freed staging leaves); no collection."""
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


_STATUS_FIELDS = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "VmHWM": "peak_rss"}


def process_memory() -> dict[str, int]:
    """This process's memory in bytes (Linux /proc; empty elsewhere): resident ("rss"), its anonymous
    part ("rss_anon": heap, tensors, thread stacks), its file-backed part ("rss_file": shared libraries,
    mapped checkpoint files) and the peak resident ("peak_rss") since the process started."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in _STATUS_FIELDS:
                    out[_STATUS_FIELDS[name]] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out
