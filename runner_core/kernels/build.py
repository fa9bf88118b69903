"""Builds the native CPU kernels into one library: tier.cpp compiled once per instruction-set tier
with that tier's flags (plain C++ for any CPU, AVX2+FMA, AVX512, AVX512-BF16 on x86-64), linked
with dispatch.cpp (the torch ops, built for the baseline ISA), which picks a tier at run time. The
build runs for any CPU of the architecture, so its cache key holds the sources, torch's version and
the compiler, not this CPU's features.

Link order is lowest tier first, after the dispatcher: an inline function compiled into several
objects is kept from the first, so every caller gets a copy built for its own tier or a lower one.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from runner_core.cache_dir import cache_root

NAME = "runner_core_cpu_kernels"
_HERE = Path(__file__).parent
DISPATCH = _HERE / "dispatch.cpp"
TIER_SOURCE = _HERE / "tier.cpp"
HEADERS = tuple(_HERE / name for name in ("tier.h", "panel_tile.h", "quant_tile.h", "attention_item.h", "argmax_row.h"))
# tier name -> (namespace and table suffix, compiler flags); lowest first
_X86_TIERS = {
    "plain": ("plain", []),
    "avx2": ("avx2", ["-mavx2", "-mfma", "-mf16c"]),
    "avx512": ("avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]),
    "avx512-bf16": ("avx512_bf16", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                    "-mavx512dq", "-mavx512bf16"]),
}


def tiers() -> dict[str, tuple[str, list[str]]]:
    """The tiers this architecture builds, lowest first (x86-64: four; anything else: plain)."""
    return dict(_X86_TIERS) if platform.machine() in ("x86_64", "AMD64") else {"plain": ("plain", [])}


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def build_dir() -> Path:
    """The cache folder of this source, torch and compiler."""
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    code = b"".join(path.read_bytes() for path in (DISPATCH, TIER_SOURCE, *HEADERS))
    key = code + torch.__version__.encode() + version.encode() + platform.machine().encode()
    path = cache_root() / "kernels" / f"cpu_kernels-{hashlib.sha256(key).hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _copy_sources(folder: Path) -> None:
    # build from a copy inside the (content-keyed) folder: the compile commands then do not depend on
    # where this package lives, so checkouts sharing a cache do not rebuild each other
    for original in (DISPATCH, TIER_SOURCE, *HEADERS):
        target = folder / original.name
        if not target.exists() or target.read_bytes() != original.read_bytes():
            tmp = folder / f".{original.name}.{os.getpid()}"
            tmp.write_bytes(original.read_bytes())
            os.replace(tmp, target)


def _compile_tier(folder: Path, name: str, suffix: str, flags: list[str]) -> Path:
    obj = folder / f"tier_{suffix}.o"
    if obj.exists():
        return obj
    tmp = folder / f".tier_{suffix}.{os.getpid()}.o"
    command = [_compiler(), "-O3", "-std=c++17", "-fPIC", "-fopenmp", *flags, f"-DRW_TIER=tier_{suffix}",
               f"-DRW_TABLE=table_{suffix}", f'-DRW_TIER_NAME="{name}"', "-c", str(folder / TIER_SOURCE.name),
               "-o", str(tmp)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the {name} kernels failed:\n{' '.join(command)}\n{result.stderr[-4000:]}")
    os.replace(tmp, obj)
    return obj


def _ensure_ninja_on_path() -> None:
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _library(folder: Path) -> Path:
    return folder / f"{NAME}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"


def is_built() -> bool:
    """Whether the library of these sources is in the cache (then `build` only loads it)."""
    return _library(build_dir()).exists()


def build() -> Path:
    """Compile (what is not cached yet) and load the library into torch.ops.runner_kernels; its path."""
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    folder = build_dir()
    _copy_sources(folder)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(lambda item: _compile_tier(folder, item[0], *item[1]), tiers().items()))
    # -fopenmp: without it ATen's parallel_for compiles to a serial loop; its OpenMP calls bind to the
    # libgomp torch loaded, so the kernels share torch's thread pool and thread count
    cpp_extension.load(name=NAME, sources=[str(folder / DISPATCH.name)], build_directory=str(folder),
                       extra_cflags=["-O3", "-fopenmp"], extra_ldflags=[str(obj) for obj in objects],
                       is_python_module=False, verbose=False)
    return _library(folder)
