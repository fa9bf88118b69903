"""Giving freed memory back to the operating system: after a model is dropped, and while one loads.

Dropping the last reference frees torch's tensors, but the C allocator keeps freed heap pages for
reuse: without a trim, a process that unloaded a model still shows tens of MiB more resident memory
than before it loaded one. `release_freed_memory()` collects cycles, empties torch's CUDA cache and
asks glibc to return free heap pages (a no-op where the C library is not glibc). While a model loads,
`heap_gives_back()` puts every block of 8 MiB or more on pages of its own, so the staging a load frees goes
back to the system at once instead of leaving holes in the heap, and `page_out` drops a mapped checkpoint
tensor's pages once they are read. The figures of
what the process holds (`resident_bytes`, `process_memory`) live here too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch


@cache
def _glibc(name: str):
    """glibc's function `name`, or None (not Linux, or a C library without it, such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _malloc_trim():
    return _glibc("malloc_trim")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
LOAD_MMAP_THRESHOLD = 8 << 20  # while loading: blocks this large or larger on pages of their own
# after it: where glibc's own adaptive thresholds end once a block of 32 MiB or more was freed (the most its
# mmap threshold grows to on 64-bit, the trim threshold twice that), as a load of any real size frees one
RUN_MMAP_THRESHOLD, RUN_TRIM_THRESHOLD = 32 << 20, 64 << 20


@contextmanager
def heap_gives_back() -> Iterator[None]:
    """While a model loads: glibc serves every allocation of LOAD_MMAP_THRESHOLD or more from pages of its
    own and unmaps them when freed. With glibc's adaptive threshold (it grows to 32 MiB as large blocks are
    freed), the parameters the build makes and the plan replaces, and the staging of fused layers, come from
    the heap, and the holes they leave between blocks that stay pile up until a trim: on qwen2.5-0.5b in
    bfloat16, 150 MiB of an int8 load's peak, 130 of int4's (benchmarks/load_memory.py). Smaller blocks (the
    quantizer's chunks, layers/quantization.CHUNK_BYTES) stay on the heap, reused chunk after chunk: a page
    fault per page of every block would cost seconds of the load. Setting a threshold ends glibc's adaptation
    for the process, so afterwards both are set where it leaves them after any load. No-op off glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)


MADV_PAGEOUT = 21  # madvise(2), Linux 5.4 on: reclaim these pages now (file pages are read again if touched)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def on_file_mapping(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes lie in a mapped file (a checkpoint tensor that safetensors maps), per
    /proc/self/maps; False for a tensor off the CPU (a device pointer may fall in a driver's mapping) and where
    that cannot be read."""
    if tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= start < high:
                    return len(fields) >= 6 and fields[5].startswith("/") and fields[4] != "0"
    except (OSError, ValueError):
        pass
    return False


def page_out(tensor: torch.Tensor) -> None:
    """Let the pages wholly under `tensor` leave this process's resident memory now (MADV_PAGEOUT). Only for a
    tensor `on_file_mapping` that nothing writes: its clean pages are dropped and read again from the file if
    touched. A load converting a large checkpoint tensor a chunk at a time pages out each chunk it has read, so
    the tensor's mapped pages never all sit beside what it becomes. No-op where madvise is missing."""
    madvise = _glibc("madvise")
    if madvise is None or tensor.numel() == 0:
        return
    start = tensor.data_ptr()
    low = -(-start // _PAGE) * _PAGE
    high = (start + tensor.numel() * tensor.element_size()) // _PAGE * _PAGE
    if high > low:
        madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), MADV_PAGEOUT)


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
