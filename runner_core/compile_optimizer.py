"""CompileOptimizer: torch.compile of the model's flat-batch forward, with a persistent cache.

What is compiled is `model(input_ids [N], positions [N]) -> hidden [N, H]`; attention is an
opaque custom op, so graphs neither break nor recompile per sequence, and N is a dynamic
dimension (1 is specialised, as dynamo does), so a continuous-batching workload needs two
graphs after warm-up. Scopes: the whole model, each decoder layer (regional: one compile
reused by every layer), or named module kinds ("mlp", "self_attn").

The cache is torch's own: after warm-up the inductor/AOTAutograd artifacts are saved with
`torch.compiler.save_cache_artifacts` into `compile_cache_dir/<key>/`, where the key hashes
everything that changes the generated code; a later process loads them before compiling.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger("runner_core")

SCOPES = ("model", "layer", "mlp", "self_attn")
TRACED_SOURCES = ("models/llama.py", "layers/linear.py", "layers/embedding.py", "layers/norm.py",
                  "layers/rotary.py", "layers/activation.py", "layers/attention.py", "forward_context.py")
ARTIFACTS = "artifacts.bin"
META = "meta.json"


def has_cxx_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


@dataclass
class CompileSettings:
    enabled: bool
    backend: str
    mode: str
    scope: str
    reason: str = ""

    @classmethod
    def resolve(cls, enabled: bool, backend: str, mode: str, scope: str, device: torch.device) -> "CompileSettings":
        """Apply `mode="auto"`: CUDA -> inductor with CUDA graphs; CPU with a C++ compiler ->
        inductor; no compiler -> eager (nothing compiled)."""
        if scope not in SCOPES:
            raise ValueError(f"compile scope {scope!r} is not one of {', '.join(SCOPES)}")
        if mode != "auto":
            return cls(enabled, backend, mode, scope, "as configured")
        if device.type == "cuda":
            return cls(enabled, "inductor", "reduce-overhead", scope, "auto: CUDA -> inductor with CUDA graphs")
        if has_cxx_compiler():
            return cls(enabled, "inductor", "default", scope, "auto: CPU with a C++ compiler -> inductor")
        return cls(False, "eager", "default", scope, "auto: no C++ compiler found -> eager")

    @property
    def options(self) -> dict:
        """Keyword arguments of torch.compile (inductor takes a mode; other backends don't)."""
        opts = {"backend": self.backend, "dynamic": True, "fullgraph": True}
        if self.backend == "inductor":
            opts["mode"] = self.mode
        return opts


def source_digest() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256()
    for rel in TRACED_SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def cache_key_factors(hf_config, dtype: torch.dtype, device: torch.device, settings: CompileSettings) -> dict:
    from runner_core import __version__

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return {
        "model_config": hashlib.sha256(hf_config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "dtype": str(dtype),
        "device": device.type,
        "capability": capability,
        "backend": settings.backend,
        "mode": settings.mode,
        "scope": settings.scope,
        "torch": torch.__version__,
        "runner_core": __version__,
        "sources": source_digest()[:16],
    }


def cache_key(factors: dict) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:20]


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _dynamo_counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)), sum(counters["graph_break"].values())


@dataclass
class CompileOptimizer:
    settings: CompileSettings
    cache_dir: Path
    factors: dict
    key: str = ""
    cache: str = "off"  # hit, miss, rebuilt (a corrupt entry was discarded) or off
    compile_seconds: dict[int, float] = field(default_factory=dict)
    _compiled: list[nn.Module] = field(default_factory=list)
    _graphs_after_warmup: int | None = None

    @classmethod
    def create(cls, config, hf_config, device: torch.device, dtype: torch.dtype, *, enabled: bool | None = None,
               backend: str | None = None, mode: str | None = None, scope: str | None = None) -> "CompileOptimizer":
        settings = CompileSettings.resolve(config.compile if enabled is None else enabled,
                                           backend or config.compile_backend, mode or config.compile_mode,
                                           scope or config.compile_scope, device)
        factors = cache_key_factors(hf_config, dtype, device, settings)
        return cls(settings, Path(config.compile_cache_dir).expanduser(), factors, cache_key(factors))

    @property
    def folder(self) -> Path:
        return self.cache_dir / self.key

    # ---- the persistent cache ---------------------------------------------------------------
    def load_cache(self) -> None:
        """Load saved artifacts for this key into torch's caches, if present and intact."""
        with _locked(self.cache_dir / f"{self.key}.lock"):
            blob, meta = self.folder / ARTIFACTS, self.folder / META
            if not blob.exists():
                self.cache = "miss"
            else:
                try:
                    data = blob.read_bytes()
                    expected = json.loads(meta.read_text())["sha256"]
                    if hashlib.sha256(data).hexdigest() != expected:
                        raise ValueError("checksum mismatch (a truncated or overwritten file)")
                    torch.compiler.load_cache_artifacts(data)
                    self.cache = "hit"
                except Exception as e:
                    logger.warning("compile cache %s is corrupt (%s); discarding it and compiling afresh", self.folder, e)
                    shutil.rmtree(self.folder, ignore_errors=True)
                    self.cache = "rebuilt"
        logger.info("compile cache %s: %s (key %s from %s)", self.cache, self.folder, self.key, self.factors)

    def save_cache(self) -> None:
        """Write this process's compile artifacts for the key (atomically; others may be reading)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, _info = saved
        with _locked(self.cache_dir / f"{self.key}.lock"):
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{ARTIFACTS}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / ARTIFACTS)
            meta = {"sha256": hashlib.sha256(data).hexdigest(), "factors": self.factors, "created": time.time()}
            tmp_meta = self.folder / f".{META}.{os.getpid()}"
            tmp_meta.write_text(json.dumps(meta, indent=1))
            os.replace(tmp_meta, self.folder / META)

    # ---- compiling --------------------------------------------------------------------------
    def apply(self, model: nn.Module) -> nn.Module:
        """Compile `model` in place per the scope (nn.Module.compile), after loading the cache."""
        self.reset(model)
        if not self.settings.enabled:
            return model
        self.load_cache()
        opts = self.settings.options
        if self.settings.scope == "model":
            targets = [model]
        elif self.settings.scope == "layer":
            targets = list(model.model.layers)
        else:
            targets = [getattr(layer, self.settings.scope) for layer in model.model.layers]
        for module in targets:
            module.compile(**opts)
        self._compiled = targets
        return model

    def reset(self, model: nn.Module) -> None:
        """Undo an earlier `apply` (back to eager)."""
        for module in model.modules():
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None
        self._compiled = []

    def warm_up(self, run, sizes: list[int]) -> None:
        """Run `run(num_tokens)` for every size so compiles happen now, then save the cache."""
        if not self._compiled:
            return
        from tqdm.auto import tqdm

        for n in tqdm(sizes, desc=f"compiling ({self.settings.backend}, {self.settings.scope})", leave=False,
                      disable=None):
            t = time.perf_counter()
            run(n)
            self.compile_seconds[n] = time.perf_counter() - t
        self._graphs_after_warmup = _dynamo_counters()[0]
        if self.cache != "hit":
            self.save_cache()

    def stats(self) -> dict:
        graphs, breaks = _dynamo_counters()
        return {
            "enabled": self.settings.enabled,
            "backend": self.settings.backend,
            "mode": self.settings.mode,
            "scope": self.settings.scope,
            "reason": self.settings.reason,
            "cache_key": self.key,
            "cache_factors": self.factors,
            "cache": self.cache,
            "compile_seconds": dict(self.compile_seconds),
            "recompiles_after_warmup": (graphs - self._graphs_after_warmup) if self._graphs_after_warmup is not None else 0,
            "graph_breaks": breaks,
        }
