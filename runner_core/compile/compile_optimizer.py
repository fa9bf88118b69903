"""CompileOptimizer: the model's flat-batch forward compiled by inductor, with a persistent cache
whose warm start skips tracing.

What is compiled is `model(input_ids [N], positions [N]) -> hidden [N, H]` (scope "model"), each
decoder layer (scope "layer": one compiled program reused by every layer), or named module kinds
("mlp", "self_attn"). Attention is an opaque custom op (`runner_core::paged_attention`), so graphs
neither break nor recompile per sequence, and the token count N is a dynamic dimension.

Two routes, chosen per optimizer (`compile_stats()["warm_start"]` says which and why):

* **aoti** (CPU + inductor, single rank; the default there). The first warm-up call exports the
  target module with `torch.export` (weights, rotary tables and the KV-pool slice are *inputs*,
  so one program serves every layer and a re-bound or shrunk pool needs nothing; N is one dynamic
  dimension >= 1, the KV-pool slot count is dynamic too) and compiles it with AOTInductor into
  `compile_cache_dir/<key>/aoti.pt2`. Every later start loads that package with
  `torch._C._aoti.AOTIModelPackageLoader`: a zip extract and a dlopen; no tracing, no inductor
  import, no vector-ISA probe, no dependence on `TORCHINDUCTOR_CACHE_DIR` (torch.library's
  custom-op wrapper still imports dynamo's module at the op's first call). The custom op runs
  through AOTInductor's proxy executor, i.e. the dispatcher calls our Python kernel, which reads
  the forward context as in eager. There are no dynamo guards at run time, so each call checks
  what the package assumes (tensor args, dtype, device, trailing dims, contiguity, one shared N);
  anything else runs eager and counts in `recompiles_after_warmup`.
* **jit** (fallback; other backends, CUDA, parallel ranks, `RUNNER_CORE_WARM_START=jit`, or an
  AOTInductor failure, which is remembered in the key's folder). `nn.Module.compile(dynamic=True,
  fullgraph=True)`: dynamo specialises N=1, so a continuous-batching workload needs two graphs
  after warm-up. The inductor/AOTAutograd artifacts are saved with
  `torch.compiler.save_cache_artifacts` into `<key>/artifacts.bin` and hot-loaded by a later
  process before compiling (inductor's vector-ISA probe is skipped when the CPU claims the ISAs
  recorded at compile time); dynamo still traces at every start.

Why aoti, and what else was tried: docs/compile.md. The cache key and the
folder's files: compile_cache.py. Static decode programs built after the warm-up: decode_plan.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from runner_core.compile.aoti_program import AOTICall, AOTIProgram
from runner_core.compile.compile_cache import (
    ARTIFACTS,
    META,
    cache_key,
    cache_key_factors,
    load_verified,
    locked,
    model_layout,
    prime_vec_isa,
    unwritable_reason,
    vec_isa_list,
    write_atomic,
)
from runner_core.config import COMPILE_SCOPES, CUDA_GRAPH_MODES
from runner_core.progress import progress, ticking

logger = logging.getLogger("runner_core")

AOTI_FAILED = "aoti.failed"  # AOTInductor failed for this key: later starts go straight to jit
WARM_START_ENV = "RUNNER_CORE_WARM_START"  # "jit" forces the torch.compile route
ROUTES = ("aoti", "jit")
WARMUP_SIZES = (1, 16)  # token counts run at a switch: 1 is specialised by dynamo; any other runs the dynamic graph


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
    def resolve(cls, enabled: bool, backend: str, mode: str, scope: str, device: torch.device) -> CompileSettings:
        """Apply `mode="auto"` (the default): CUDA -> inductor's "default" mode, whose graphs the runner's
        own decode CUDA graphs capture (static metadata buffers, memory in the KV-pool plan: decode_plan.py);
        CPU with a C++ compiler -> inductor "max-autotune"; no compiler -> eager (nothing compiled)."""
        if scope not in COMPILE_SCOPES:
            raise ValueError(f"compile scope {scope!r} is not one of {', '.join(COMPILE_SCOPES)}")
        if mode != "auto":
            reason = "as configured"
            if device.type == "cuda" and backend == "inductor" and mode in CUDA_GRAPH_MODES:
                reason += ("; inductor's CUDA graph trees, split around the attention op (cudagraph_unsafe), "
                           "their memory outside the KV-pool plan")
            return cls(enabled=enabled, backend=backend, mode=mode, scope=scope, reason=reason)
        if device.type == "cuda":
            return cls(enabled=enabled, backend="inductor", mode="default", scope=scope,
                       reason="auto: CUDA -> inductor, decode steps replayed from the runner's CUDA graphs")
        if has_cxx_compiler():
            return cls(enabled=enabled, backend="inductor", mode="max-autotune", scope=scope,
                       reason="auto: CPU with a C++ compiler -> inductor max-autotune")
        return cls(enabled=False, backend="eager", mode="default", scope=scope,
                   reason="auto: no C++ compiler found -> eager")

    @property
    def options(self) -> dict:
        """Keyword arguments of torch.compile (inductor takes a mode; other backends don't)."""
        opts = {"backend": self.backend, "dynamic": True, "fullgraph": True}
        if self.backend == "inductor":
            opts["mode"] = self.mode
        return opts

    @property
    def inductor_configs(self) -> dict:
        """The mode as inductor settings for AOTInductor (CUDA-graph ones dropped: CPU only)."""
        import torch._inductor

        return {k: v for k, v in torch._inductor.list_mode_options(self.mode).items() if "cudagraph" not in k}


def _dynamo_counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process; (0, 0) if dynamo never loaded."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)), sum(counters["graph_break"].values())


def cuda_graphs_status(device_type: str, mode: str | None, enabled: bool, programs=None) -> str:
    if device_type != "cuda":
        return f"skipped: {device_type.upper()} device (CUDA graphs capture CUDA kernel launches; no CUDA device here)"
    if not enabled:
        return "off: compilation is off"
    if mode in CUDA_GRAPH_MODES:
        return f"by torch.compile mode={mode!r} (inductor CUDA graph trees); no runner-level capture sizes"
    if programs is not None and programs.graphs:  # CUDA: CUDAGraphDecodePrograms
        return (f"captured decode sizes {sorted(programs.graphs)} "
                f"({programs.memory_bytes / 2**20:.1f} MiB of graph memory)")
    return "off: no capture sizes (compile_sizes=[])"


# ---- the optimizer --------------------------------------------------------------------------
@dataclass
class CompileOptimizer:
    settings: CompileSettings
    cache_dir: Path
    factors: dict
    key: str = ""
    cache: str = "off"  # hit, miss, rebuilt (a corrupt entry was discarded) or off
    compile_seconds: dict[int, float] = field(default_factory=dict)
    route: str = "jit"  # "aoti" or "jit" (see the module docstring), decided by apply()
    route_reason: str = ""
    world_size: int = 1
    load_seconds: float = 0.0
    artifacts_cache: str = "off"  # the jit route's inductor artifacts: hit, miss or rebuilt
    decode_reason: str = ""  # why the decode programs are what they are (they live on the ForwardPass)
    uncached_reason: str = ""  # set when the cache folder cannot be written: compiles run without it
    _compiled: list[nn.Module] = field(default_factory=list)
    _graphs_after_warmup: int | None = None
    _program: AOTIProgram | None = None
    _model: nn.Module | None = None

    @classmethod
    def create(cls, config, hf_config, *, enabled: bool | None = None, backend: str | None = None,
               mode: str | None = None, scope: str | None = None) -> CompileOptimizer:
        """The optimizer for `config` (a RunnerConfig) with these overrides. Under pipeline
        parallelism the "model" scope compiles each decoder layer instead: the stage boundaries
        send and receive outside compiled graphs."""
        device = config.torch_device
        scope = scope or config.compile_scope
        staged = config.pipeline_parallel_size > 1 and scope == "model"
        settings = CompileSettings.resolve(config.compile if enabled is None else enabled,
                                           backend or config.compile_backend, mode or config.compile_mode,
                                           "layer" if staged else scope, device)
        if staged:
            settings.reason += "; pipeline parallelism compiles each decoder layer (scope 'layer')"
        factors = cache_key_factors(hf_config, config.torch_dtype, device, settings)
        return cls(settings=settings, cache_dir=Path(config.compile_cache_dir).expanduser(), factors=factors,
                   key=cache_key(factors), world_size=config.world_size)

    @property
    def folder(self) -> Path:
        return self.cache_dir / self.key

    # ---- the persistent cache (jit route) ---------------------------------------------------
    def load_cache(self) -> None:
        """Load saved artifacts for this key into torch's caches, if present and intact."""
        def load(data, info):
            torch.compiler.load_cache_artifacts(data)
            prime_vec_isa(info.get("vec_isa"))

        self.artifacts_cache, seconds = load_verified(self.cache_dir, self.key, self.factors, "cache", ARTIFACTS,
                                                      META, load)
        self.load_seconds += seconds

    def save_cache(self) -> None:
        """Write this process's compile artifacts for the key (atomically; others may be reading)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, _info = saved
        try:
            with locked(self.cache_dir / f"{self.key}.lock"):
                self.folder.mkdir(parents=True, exist_ok=True)
                write_atomic(self.folder / ARTIFACTS, data)
                meta = {"sha256": hashlib.sha256(data).hexdigest(), "factors": self.factors, "created": time.time(),
                        "vec_isa": vec_isa_list()}
                write_atomic(self.folder / META, json.dumps(meta, indent=1).encode())
        except OSError as e:  # e.g. the disk filled up: this run is compiled, the next start compiles again
            self.uncached_reason = f"saving to {self.folder} failed: {type(e).__name__}: {e}"
            logger.warning("the compile cache was not saved (%s); generation goes on, the next start compiles "
                           "again", self.uncached_reason)

    # ---- the package (aoti route) -----------------------------------------------------------
    def load_package(self) -> None:
        """Load this key's AOTInductor package, if present and intact (else cache = miss/rebuilt)."""
        self._program = AOTIProgram(self)
        self.cache = self._program.load_cached()
        if self.cache == "rebuilt":
            self._program = AOTIProgram(self)

    # ---- compiling --------------------------------------------------------------------------
    def _targets(self, model: nn.Module) -> list[nn.Module]:
        scopes = getattr(model, "compile_scopes", COMPILE_SCOPES)  # a model may compile in fewer scopes
        if self.settings.scope not in scopes:
            raise ValueError(f"{type(model).__name__} compiles with compile_scope {', '.join(map(repr, scopes))} "
                             f"only, not {self.settings.scope!r}; use compile_scope={scopes[0]!r}")
        if self.settings.scope == "model":
            return [model]
        if self.settings.scope == "layer":
            return list(model.model.layers)
        return [getattr(layer, self.settings.scope) for layer in model.model.layers]

    def _choose_route(self, targets: list[nn.Module]) -> tuple[str, str]:
        s, device = self.settings, self.factors["device"]
        forced = os.environ.get(WARM_START_ENV, "").strip().lower()
        if forced and forced not in ROUTES:
            logger.warning("%s=%r is not one of %s; ignoring it", WARM_START_ENV, forced, ", ".join(ROUTES))
        if forced == "jit":
            return "jit", f"{WARM_START_ENV}=jit"
        if s.backend != "inductor":
            return "jit", f"backend {s.backend!r}: AOTInductor packages are inductor's"
        if device != "cpu":
            return "jit", f"{device}: torch.compile keeps CUDA graphs (reduce-overhead), AOTInductor has none"
        if self.world_size > 1:
            return "jit", "parallel ranks: collectives and rank-local groups need dynamo's guards"
        if len({type(t) for t in targets}) != 1:
            return "jit", "the scope's modules are of different classes"
        if len({model_layout(t) for t in targets}) != 1:  # e.g. dense and MoE layers of one class
            return "jit", "the scope's modules hold different parameters (one package serves only one layout)"
        failed = self.folder / AOTI_FAILED
        if failed.exists():
            return "jit", f"AOTInductor failed for this key before ({failed.read_text().strip()[:200]})"
        return "aoti", "CPU + inductor: an AOTInductor package; a warm start loads it without tracing"

    def apply(self, model: nn.Module) -> nn.Module:
        """Compile `model` in place per the scope, after loading the cache (the aoti route builds
        its package at the first warm-up call when the cache misses)."""
        self.reset(model)
        if not self.settings.enabled:
            return model
        self._model = model
        self.factors = {**self.factors, "layout": model_layout(model)}
        self.key = cache_key(self.factors)
        targets = self._targets(model)
        self.uncached_reason = unwritable_reason(self.cache_dir) or ""
        if self.uncached_reason:
            logger.warning("compile cache folder %s is not writable (%s); compiling without the persistent cache "
                           "(set compile_cache_dir to a writable folder to keep compiles across starts)",
                           self.cache_dir, self.uncached_reason)
            self.route, self.route_reason = "jit", f"no persistent cache: {self.uncached_reason}"
        else:
            self.route, self.route_reason = self._choose_route(targets)
        if self.route == "aoti":
            self.load_package()
            for module in targets:
                module._compiled_call_impl = AOTICall(module, self._program)
            self._compiled = targets
        else:
            self._apply_jit(targets)
        return model

    def _apply_jit(self, targets: list[nn.Module]) -> None:
        if not self.uncached_reason:
            self.load_cache()
        self.cache = self.artifacts_cache
        for module in targets:
            module.compile(**self.settings.options)
        self._compiled = targets

    def reset(self, model: nn.Module) -> None:
        """Undo an earlier `apply` (back to eager; the decode programs release their own packed weights)."""
        for module in model.modules():
            if module._compiled_call_impl is not None:
                module._compiled_call_impl = None
        self._compiled = []

    def warm_up(self, run, sizes: list[int]) -> None:
        """Run `run(num_tokens)` for every size so compiles happen now (`finish_warm_up` saves the
        cache). An AOTInductor failure is remembered for the key and the jit route takes over."""
        if not self._compiled:
            return
        try:
            self._run_sizes(run, sizes)
        except Exception as e:
            if self.route != "aoti":
                raise
            logger.warning("AOTInductor packaging failed (%s: %s); using torch.compile with the compile cache "
                           "instead", type(e).__name__, e)
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                write_atomic(self.folder / AOTI_FAILED, f"{type(e).__name__}: {e}".encode())
            except OSError:
                pass
            self.reset(self._model)
            self.route, self.route_reason = "jit", f"AOTInductor failed: {type(e).__name__}: {e}"
            self.compile_seconds.clear()
            self._apply_jit(self._targets(self._model))
            self._run_sizes(run, sizes)

    def finish_warm_up(self, decode_reason: str) -> None:
        """After the warm-up and the decode programs' builds: note the graph count and (jit route)
        save the inductor artifacts unless they were loaded from the cache."""
        self.decode_reason = decode_reason
        self._graphs_after_warmup = _dynamo_counters()[0]
        if self.settings.enabled and self.route == "jit" and self.artifacts_cache != "hit" and not self.uncached_reason:
            self.save_cache()

    def _run_sizes(self, run, sizes: list[int]) -> None:
        """Compile each size in turn; the bar names the size in progress (one size can take most of
        a cold compile, so its elapsed time keeps moving) and ends with each size's seconds."""
        desc = f"torch.compile ({self.settings.backend}, {self.settings.scope}, {self.route})"
        with progress(desc=desc, total=len(sizes), unit="size") as bar, ticking(bar):
            for n in sizes:
                bar.set_postfix_str(f"compiling for {n} tokens")
                t = time.perf_counter()
                run(n)
                self.compile_seconds[n] = time.perf_counter() - t
                bar.update(1)
            bar.set_postfix_str(", ".join(f"{k} tokens: {v:.1f} s" for k, v in self.compile_seconds.items()))

    def stats(self, decode_programs=None) -> dict:
        """compile_stats(): settings, route, cache, timings, recompiles, and `decode_programs` (the
        forward pass's) with the reason for them."""
        graphs, breaks = _dynamo_counters()
        # dynamo's counters are per process: graphs any compiled code made since the warm-up (the
        # jit route, the decode programs); the AOTInductor package counts the inputs it refused
        recompiles = (graphs - self._graphs_after_warmup) if self._graphs_after_warmup is not None else 0
        if self.route == "aoti" and self._program is not None:
            recompiles += self._program.misses
        return {
            "enabled": self.settings.enabled,
            "backend": self.settings.backend,
            "mode": self.settings.mode,
            "scope": self.settings.scope,
            "reason": self.settings.reason,
            "warm_start": self.route if self.settings.enabled else None,
            "warm_start_reason": self.route_reason,
            "cache_key": self.key,
            "cache_factors": self.factors,
            "cache": "uncached" if self.uncached_reason else self.cache,
            "uncached_reason": self.uncached_reason or None,
            "cache_load_seconds": self.load_seconds,
            "compile_seconds": dict(self.compile_seconds),
            "recompiles_after_warmup": recompiles,
            "graph_breaks": breaks,
            "cuda_graphs": cuda_graphs_status(self.factors["device"], self.settings.mode, self.settings.enabled,
                                              decode_programs),
            "decode_programs": {**(decode_programs.stats() if decode_programs else {"sizes": []}),
                                "reason": self.decode_reason},
        }
