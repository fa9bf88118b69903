"""The persistent compile cache: the key and its factors, and the key's folder of files written
atomically under a file lock and verified by checksum when read.

The key hashes everything that changes the generated code (model config, the model's parameter
layout and pipeline stage, dtype, device and CPU flags, compile options, torch and project
versions, traced sources). Files are written to a temporary name and renamed; reads verify a
sha256 from the folder's metadata; a corrupt entry is discarded with a warning and rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from runner_core import faults
from runner_core.config import project_version

logger = logging.getLogger("runner_core")

# the modules whose source is traced into compiled programs: any edit invalidates the cache
TRACED_SOURCES = ("models/*.py", "layers/*.py", "compile/aoti_program.py")
ARTIFACTS = "artifacts.bin"  # jit route: torch.compiler.save_cache_artifacts
META = "meta.json"


def source_digest() -> str:
    root = Path(__file__).parents[1]  # runner_core/
    h = hashlib.sha256()
    for pattern in TRACED_SOURCES:
        for path in sorted(root.glob(pattern)):
            h.update(path.read_bytes())
    return h.hexdigest()


def cpu_fingerprint() -> str:
    """Machine and CPU feature flags: generated C++ is built for the host's vector ISA."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        flags = "".join(line for line in info.splitlines() if line.startswith(("flags", "Features")))
    except OSError:
        flags = platform.processor()
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:16]


def model_layout(model: nn.Module) -> str:
    """Parameter and buffer names, shapes and dtypes (tensor-parallel shards and pipeline stages
    differ), the pipeline stage's position, and the model's `compile_key` if it has one (a digest of
    the code it traces from outside runner_core); the KV-pool size is left out (it is dynamic)."""
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        shape = "pool" if name.endswith("kv_cache") else tuple(t.shape)
        h.update(f"{name}:{shape}:{t.dtype};".encode())
    stage = getattr(getattr(model, "model", None), "stage", None)
    if stage is not None:
        h.update(f"stage:{stage.is_first}:{stage.is_last}".encode())
    h.update(getattr(model, "compile_key", "").encode())  # code traced from outside runner_core (the fallback's)
    return h.hexdigest()[:16]


def _config_digest(hf_config) -> str:
    """The model config without where it was read from (`_name_or_path`): the same model in
    another folder compiles to the same code."""
    config = {k: v for k, v in hf_config.to_dict().items() if k != "_name_or_path"}
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_key_factors(hf_config, dtype: torch.dtype, device: torch.device, settings,
                      model: nn.Module | None = None) -> dict:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    factors = {
        "model_config": _config_digest(hf_config),
        "dtype": str(dtype),
        "device": device.type,
        "capability": capability,
        "cpu": cpu_fingerprint() if device.type == "cpu" else None,
        "backend": settings.backend,
        "mode": settings.mode,
        "scope": settings.scope,
        "torch": torch.__version__,
        "runner_core": project_version(),
        "sources": source_digest()[:16],
    }
    if model is not None:
        factors["layout"] = model_layout(model)
    return factors


def cache_key(factors: dict) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:20]


@contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, data: bytes) -> None:
    faults.fire("cache_write", path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
        raise


def unwritable_reason(folder: Path) -> str | None:
    """Why files cannot be written under `folder` (created if missing), or None when they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe.{os.getpid()}"
        write_atomic(probe, b"")
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def vec_isa_list() -> list[str] | None:
    """The vector ISAs inductor found working in this process (probed by its first compile)."""
    try:
        from torch._inductor import cpu_vec_isa

        return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    except Exception:
        return None


def prime_vec_isa(recorded: list[str] | None) -> bool:
    """Skip inductor's vector-ISA probe (~1 s: a C++ build and a child process per start) when
    the CPU claims exactly the ISAs the probe accepted when this key was compiled (the key holds
    the CPU flags). `cpp.vec_isa_ok` is patched only while the list is computed, so compile
    settings, and with them inductor's cache keys, are unchanged."""
    if not recorded:
        return False
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor import cpu_vec_isa

        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return False  # already probed in this process
        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            claimed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        if claimed != recorded:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()
            return False
        return True
    except Exception:  # internals moved: probing as usual is always correct
        return False


def load_verified(cache_dir: Path, key: str, factors: dict, what: str, blob_name: str, meta_name: str,
              load) -> tuple[str, float]:
    """Under the key's lock: `load(data, meta)` the key's `blob_name` if present and its sha256
    matches `meta_name`; a missing file is a miss, a bad one is discarded with a warning.
    Returns (hit, miss or rebuilt; seconds)."""
    t = time.perf_counter()
    with locked(cache_dir / f"{key}.lock"):
        folder = cache_dir / key
        blob, meta = folder / blob_name, folder / meta_name
        if not blob.exists():
            status = "miss"
        else:
            try:
                data = blob.read_bytes()
                info = json.loads(meta.read_text())
                if hashlib.sha256(data).hexdigest() != info["sha256"]:
                    raise ValueError("checksum mismatch (a truncated or overwritten file)")
                load(data, info)
                status = "hit"
            except Exception as e:
                logger.warning("compile %s %s is corrupt (%s); discarding it and compiling afresh", what, blob, e)
                for name in (blob_name, meta_name):
                    (folder / name).unlink(missing_ok=True)
                status = "rebuilt"
    logger.info("compile %s %s: %s (key %s from %s)", what, folder, status, key, factors)
    return status, time.perf_counter() - t

