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

Why aoti. Measured on small-llama (fp32, 2 shared CPU cores: noisy), seconds from "compile
requested" to "warm-up done" in a fresh process; cold = empty compile_cache_dir and empty
TORCHINDUCTOR_CACHE_DIR, warm = the same folders again. benchmarks/compile.py, final code:

    scope   route                          cold s   warm s   warm/cold
    model   aoti (kept)                     24.3     0.53      2.2%
    model   jit: torch.compile + mega-cache 27.0     5.85     21.7%
    layer   aoti (kept)                     16.7     0.51      3.1%
    layer   jit: torch.compile + mega-cache 15.2     3.00     19.8%

(an earlier run: 26.0/0.58, 29.3/7.14, 17.4/0.55, 16.0/2.96). Same run, aoti route, eager ->
compiled tok/s: decode batch 1 75.9 -> 85.3 (model) / 74.7 -> 85.0 (layer), batch 32 1027 -> 1134
/ 1031 -> 1117, mixed workload 512 -> 572 / 545 -> 564; greedy tokens equal 64/64; 0 recompiles.

Tried on the way (experiment scripts, same machine, busier, so cold/warm are higher):
  * `torch.compile(fn, fullgraph=True, dynamic=True).aot_compile(((module, *args), {}))` per
    graph (N=1 and dynamic), saved with `save_compiled_function`, loaded with
    `torch.compiler.load_compiled_function`: correct tokens, zero recompiles; warm 4.1 s (layer)
    / 2.6 s (model) vs the mega-cache's 5.4 / 10.1 in the same session. But its artifacts still
    need inductor's kernel cache (with an empty TORCHINDUCTOR_CACHE_DIR the warm start was 14.0 s:
    every kernel is rebuilt), it must be loaded under the inference mode it was traced in
    (dispatch-key guards), needs `specialize_float=True` (else TensorifyScalarRestartAnalysis),
    pays ~1.4 s importing dynamo plus ~1 s of inductor's vector-ISA probe, and checks guards in
    Python on every call.
  * `TORCH_CACHING_PRECOMPILE=1` (dynamo's own cache inside the mega-cache): the warm load failed
    ("Name '__builtins_dict___2' already exists in scope").
  * AOTInductor with two packages (N=1 specialised + dynamic N>=2): warm 3.3 s / 2.7 s through
    `aoti_load_package` (which imports inductor and runs the ISA probe), 7.7 s with an empty
    inductor cache, but cold 49 s / 48 s. An N=1-specialised package was no faster at N=1 than the
    dynamic one (9.06 vs 9.12 ms per forward), so one dynamic package (cold 17.7 s, layer) loaded
    by the C++ loader directly: ~5 ms to load; the rest of the warm figure is the warm-up runs and
    the import of dynamo that torch.library's custom-op wrapper does on the op's first call.
  * Steady state (min of 30 forwards, layer scope, ms at N=1 / 32 / 256): eager 10.3/19.3/104,
    jit 10.2/19.8/-, aot_compile 9.7/18.8/81.7, AOTInductor 9.1/17.4/81.7 (quiet machine later:
    eager 11.1/20.1/48.8@128, aoti 9.7/18.6/46.8@128). The mm's are extern BLAS calls on both
    sides, so compiled decode is ~1.1x eager here (1.08-1.14x), short of the 1.3x target; inductor's
    `freezing` (weights prepacked as constants) measured 1.45x at N=1 and 1.8x at N=32 on the
    jit route, but it makes the KV pool and the weights graph constants (a re-bound pool would be
    missed silently) and one program per layer instance: not adopted.

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
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from runner_core.layers.linear import packed_weights_in_use, unpack_linear_weights

logger = logging.getLogger("runner_core")

SCOPES = ("model", "layer", "mlp", "self_attn")
TRACED_SOURCES = ("models/llama.py", "layers/linear.py", "layers/embedding.py", "layers/norm.py",
                  "layers/rotary.py", "layers/activation.py", "layers/attention.py", "forward_context.py",
                  "compile_optimizer.py", "decode_programs.py")  # these two: their wrappers are traced
ARTIFACTS = "artifacts.bin"  # jit route: torch.compiler.save_cache_artifacts
META = "meta.json"
AOTI_PACKAGE = "aoti.pt2"  # aoti route: the AOTInductor package
AOTI_META = "aoti.json"
AOTI_FAILED = "aoti.failed"  # AOTInductor failed for this key: later starts go straight to jit
WARM_START_ENV = "RUNNER_CORE_WARM_START"  # "jit" forces the torch.compile route
ROUTES = ("aoti", "jit")


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

    @property
    def inductor_configs(self) -> dict:
        """The mode as inductor settings for AOTInductor (CUDA-graph ones dropped: CPU only)."""
        import torch._inductor

        return {k: v for k, v in torch._inductor.list_mode_options(self.mode).items() if "cudagraph" not in k}


def source_digest() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256()
    for rel in TRACED_SOURCES:
        h.update((root / rel).read_bytes())
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
    differ), and the pipeline stage's position; the KV-pool size is left out (it is dynamic)."""
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        shape = "pool" if name.endswith("kv_cache") else tuple(t.shape)
        h.update(f"{name}:{shape}:{t.dtype};".encode())
    stage = getattr(getattr(model, "model", None), "stage", None)
    if stage is not None:
        h.update(f"stage:{stage.is_first}:{stage.is_last}".encode())
    return h.hexdigest()[:16]


def cache_key_factors(hf_config, dtype: torch.dtype, device: torch.device, settings: CompileSettings,
                      model: nn.Module | None = None) -> dict:
    from runner_core import __version__

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    factors = {
        "model_config": hashlib.sha256(hf_config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "dtype": str(dtype),
        "device": device.type,
        "capability": capability,
        "cpu": cpu_fingerprint() if device.type == "cpu" else None,
        "backend": settings.backend,
        "mode": settings.mode,
        "scope": settings.scope,
        "torch": torch.__version__,
        "runner_core": __version__,
        "sources": source_digest()[:16],
    }
    if model is not None:
        factors["layout"] = model_layout(model)
    return factors


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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _dynamo_counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process; (0, 0) if dynamo never loaded."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)), sum(counters["graph_break"].values())


def _vec_isa_list() -> list[str] | None:
    """The vector ISAs inductor found working in this process (probed by its first compile)."""
    try:
        from torch._inductor import cpu_vec_isa

        return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    except Exception:
        return None


def _prime_vec_isa(recorded: list[str] | None) -> bool:
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


def cuda_graphs_status(device_type: str, mode: str, enabled: bool, programs=None) -> str:
    if device_type != "cuda":
        return f"skipped: {device_type.upper()} device (CUDA graphs capture CUDA kernel launches; no CUDA device here)"
    if not enabled:
        return "off: compilation is off"
    if mode in ("reduce-overhead", "max-autotune"):
        return f"by torch.compile mode={mode!r} (inductor CUDA graph trees); no runner-level capture sizes"
    if programs is not None and getattr(programs, "graphs", None):
        return (f"captured decode sizes {sorted(programs.graphs)} "
                f"({programs.memory_bytes / 2**20:.1f} MiB of graph memory)")
    return "off: no capture sizes (compile_sizes=[])"


# ---- the AOTInductor route ------------------------------------------------------------------
class _Functional(nn.Module):
    """`module` with its parameters and buffers as inputs: forward(tensors, args)."""

    def __init__(self, module: nn.Module, names: list[str]):
        super().__init__()
        self.__dict__["_target"] = module  # not a submodule: its tensors must not become constants
        self.names = names

    def forward(self, tensors: list, args: list):
        return torch.func.functional_call(self._target, dict(zip(self.names, tensors)), tuple(args))


def _tensor_names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]


def _tensor_refs(module: nn.Module, names: list[str]) -> list[tuple[dict, str]]:
    """(dict, key) of each named parameter or buffer: read at every call, so re-bound tensors
    (a shrunk KV pool) are picked up; a dict lookup is cheaper than Module.__getattr__."""
    refs = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        sub = module.get_submodule(prefix)
        store = sub._parameters if attr in sub._parameters else sub._buffers
        if store.get(attr) is None:
            raise ValueError(f"{type(module).__name__} has no tensor {name!r} that the package expects")
        refs.append((store, attr))
    return refs


@contextmanager
def _eager_hooks_off(module: nn.Module):
    """Trace the eager forward: compiled hooks of `module` and its submodules off meanwhile."""
    hooks = {m: m._compiled_call_impl for m in module.modules() if m._compiled_call_impl is not None}
    for m in hooks:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, hook in hooks.items():
            m._compiled_call_impl = hook


class _AOTIProgram:
    """One AOTInductor package serving every target module of the scope (all one class), for any
    token count >= 1, or, with `size`, a static decode program of exactly `size` tokens exported
    with the layers' prepacked weights (layers/linear.py)."""

    def __init__(self, optimizer: "CompileOptimizer", size: int | None = None):
        self.opt, self.size = optimizer, size
        self.package, self.meta_name = ((AOTI_PACKAGE, AOTI_META) if size is None
                                        else (f"decode-{size}.pt2", f"decode-{size}.json"))
        self.loader = None
        self.names: list[str] = []
        self.signature: list[tuple[torch.dtype, torch.device, tuple[int, ...]]] = []
        self.out_kind = "tensor"
        self.misses = 0

    # -- loading and building
    def load(self, path: Path, meta: dict) -> None:
        from torch.utils._pytree import treespec_loads

        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        out_spec = treespec_loads(loader.get_call_spec()[1])
        if out_spec.is_leaf():
            out_kind = "tensor"
        elif out_spec.type is tuple and all(c.is_leaf() for c in out_spec.children()):
            out_kind = "tuple"
        else:
            raise ValueError(f"unsupported output structure {out_spec}")
        self.names = meta["names"]
        self.signature = [(getattr(torch, d.split(".")[-1]), torch.device(dev), tuple(rest))
                          for d, dev, rest in meta["signature"]]
        self.out_kind, self.loader = out_kind, loader

    def build(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Export `module` on these (warm-up) args, compile, save and load the package."""
        import torch._inductor

        if kwargs or not args or not all(isinstance(a, torch.Tensor) and a.dim() >= 1 for a in args):
            raise ValueError("AOTInductor packaging needs positional tensor arguments only")
        n = args[0].shape[0]
        if any(a.shape[0] != n for a in args):
            raise ValueError("the arguments do not share one token dimension")
        names = _tensor_names(module)
        tensors = [t for _, t in list(module.named_parameters()) + list(module.named_buffers())]
        tensor_dims = [{2: torch.export.Dim.DYNAMIC} if name.endswith("kv_cache") and t.dim() == 4 else None
                       for name, t in zip(names, tensors)]
        if self.size is None:
            # an example with N >= 2, so N is not specialised to 1 (one program serves every N)
            example = [a if n >= 2 else torch.cat([a, a]) for a in args]
            arg_dims, packed = [{0: torch.export.Dim("tokens", min=1)}] * len(example), nullcontext()
        else:
            example, arg_dims, packed = list(args), [None] * len(args), packed_weights_in_use()
        with _eager_hooks_off(module), packed:
            ep = torch.export.export(_Functional(module, names), (tensors, example),
                                     dynamic_shapes=(tensor_dims, arg_dims), strict=False)
        has_attention = any(type(m).__name__ == "Attention" for m in module.modules())
        op = torch.ops.runner_core.paged_attention.default
        if has_attention and not any(node.target is op for node in ep.graph.nodes):
            raise RuntimeError("attention was traced through instead of kept as the runner_core::paged_attention op")
        folder = self.opt.folder
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{os.getpid()}.{self.package}"  # the packager wants a name ending in .pt2
        try:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                                     inductor_configs=self.opt.settings.inductor_configs)
            data = tmp.read_bytes()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        meta = {"sha256": hashlib.sha256(data).hexdigest(), "names": names, "module": type(module).__name__,
                "signature": [(str(a.dtype), str(a.device), list(a.shape[1:])) for a in args],
                "vec_isa": _vec_isa_list(), "factors": self.opt.factors, "created": time.time()}
        with _locked(self.opt.cache_dir / f"{self.opt.key}.lock"):
            os.replace(tmp, folder / self.package)
            _write_atomic(folder / self.meta_name, json.dumps(meta, indent=1).encode())
        self.load(folder / self.package, meta)

    def load_cached(self) -> str:
        """Load this program's package from the key's folder if present and intact: hit, miss or rebuilt."""
        return self.opt._load_verified("package", self.package, self.meta_name,
                                       lambda data, info: self.load(self.opt.folder / self.package, info))

    # -- running
    def matches(self, args: tuple) -> bool:
        sig = self.signature
        if len(args) != len(sig):
            return False
        n = args[0].shape[0] if isinstance(args[0], torch.Tensor) and args[0].dim() else 0
        for a, (dtype, device, rest) in zip(args, sig):
            if not (isinstance(a, torch.Tensor) and a.dtype == dtype and a.device == device and a.dim() == len(rest) + 1
                    and a.shape[0] == n and tuple(a.shape[1:]) == rest and a.is_contiguous()):
                return False
        return n >= 1 and (self.size is None or n == self.size)

    def miss(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.misses == 0:
            logger.warning("compiled %s got inputs its AOTInductor package was not built for; running it eager",
                           type(module).__name__)
        self.misses += 1
        return module._call_impl(*args, **kwargs)


class _AOTICall:
    """Installed as a target's `_compiled_call_impl`: runs the package with the target's own
    tensors (the first call builds the package when the cache missed)."""

    __slots__ = ("module", "program", "refs")

    def __init__(self, module: nn.Module, program: _AOTIProgram):
        self.module, self.program, self.refs = module, program, None

    def __call__(self, *args, **kwargs):
        p = self.program
        if p.loader is None:
            p.build(self.module, args, kwargs)
        if self.refs is None:
            self.refs = _tensor_refs(self.module, p.names)
        if kwargs or not p.matches(args):
            return p.miss(self.module, args, kwargs)
        out = p.loader.boxed_run([*[store[k] for store, k in self.refs], *args])
        return out[0] if p.out_kind == "tensor" else tuple(out)


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
    decode_programs: object | None = None  # DecodePrograms, attached by finish_warm_up
    decode_reason: str = ""
    _compiled: list[nn.Module] = field(default_factory=list)
    _graphs_after_warmup: int | None = None
    _program: _AOTIProgram | None = None
    _model: nn.Module | None = None

    @classmethod
    def create(cls, config, hf_config, device: torch.device, dtype: torch.dtype, *, enabled: bool | None = None,
               backend: str | None = None, mode: str | None = None, scope: str | None = None) -> "CompileOptimizer":
        settings = CompileSettings.resolve(config.compile if enabled is None else enabled,
                                           backend or config.compile_backend, mode or config.compile_mode,
                                           scope or config.compile_scope, device)
        factors = cache_key_factors(hf_config, dtype, device, settings)
        world = getattr(config, "tensor_parallel_size", 1) * getattr(config, "pipeline_parallel_size", 1)
        return cls(settings, Path(config.compile_cache_dir).expanduser(), factors, cache_key(factors),
                   world_size=world)

    @property
    def folder(self) -> Path:
        return self.cache_dir / self.key

    # ---- the persistent cache (jit route) ---------------------------------------------------
    def _load_verified(self, what: str, blob_name: str, meta_name: str, load) -> str:
        """Under the key's lock: `load(data, meta)` the key's `blob_name` if present and its sha256
        matches `meta_name`; a missing file is a miss, a bad one is discarded with a warning.
        Returns hit, miss or rebuilt."""
        t = time.perf_counter()
        with _locked(self.cache_dir / f"{self.key}.lock"):
            blob, meta = self.folder / blob_name, self.folder / meta_name
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
                        (self.folder / name).unlink(missing_ok=True)
                    status = "rebuilt"
        self.load_seconds += time.perf_counter() - t
        logger.info("compile %s %s: %s (key %s from %s)", what, self.folder, status, self.key, self.factors)
        return status

    def load_cache(self) -> None:
        """Load saved artifacts for this key into torch's caches, if present and intact."""
        def load(data, info):
            torch.compiler.load_cache_artifacts(data)
            _prime_vec_isa(info.get("vec_isa"))

        self.artifacts_cache = self._load_verified("cache", ARTIFACTS, META, load)

    def save_cache(self) -> None:
        """Write this process's compile artifacts for the key (atomically; others may be reading)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, _info = saved
        with _locked(self.cache_dir / f"{self.key}.lock"):
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.folder / ARTIFACTS, data)
            meta = {"sha256": hashlib.sha256(data).hexdigest(), "factors": self.factors, "created": time.time(),
                    "vec_isa": _vec_isa_list()}
            _write_atomic(self.folder / META, json.dumps(meta, indent=1).encode())

    # ---- the package (aoti route) -----------------------------------------------------------
    def load_package(self) -> None:
        """Load this key's AOTInductor package, if present and intact (else cache = miss/rebuilt)."""
        self._program = _AOTIProgram(self)
        self.cache = self._program.load_cached()
        if self.cache == "rebuilt":
            self._program = _AOTIProgram(self)

    # ---- compiling --------------------------------------------------------------------------
    def _targets(self, model: nn.Module) -> list[nn.Module]:
        if self.settings.scope == "model":
            return [model]
        if self.settings.scope == "layer":
            return list(model.model.layers)
        return [getattr(layer, self.settings.scope) for layer in model.model.layers]

    def _choose_route(self, targets: list[nn.Module]) -> tuple[str, str]:
        s, device = self.settings, self.factors.get("device", "cpu")
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
        self.route, self.route_reason = self._choose_route(targets)
        if self.route == "aoti":
            self.load_package()
            for module in targets:
                module._compiled_call_impl = _AOTICall(module, self._program)
            self._compiled = targets
        else:
            self._apply_jit(targets)
        return model

    def _apply_jit(self, targets: list[nn.Module]) -> None:
        self.load_cache()
        self.cache = self.artifacts_cache
        for module in targets:
            module.compile(**self.settings.options)
        self._compiled = targets

    def reset(self, model: nn.Module) -> None:
        """Undo an earlier `apply` (back to eager), dropping the decode programs' packed weights."""
        unpack_linear_weights(model)
        for module in model.modules():
            if getattr(module, "_compiled_call_impl", None) is not None:
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
                _write_atomic(self.folder / AOTI_FAILED, f"{type(e).__name__}: {e}".encode())
            except OSError:
                pass
            self.reset(self._model)
            self.route, self.route_reason = "jit", f"AOTInductor failed: {type(e).__name__}: {e}"
            self.compile_seconds.clear()
            self._apply_jit(self._targets(self._model))
            self._run_sizes(run, sizes)

    def finish_warm_up(self, decode_programs, reason: str) -> None:
        """After the warm-up and the decode programs' builds: note the graph count and (jit route)
        save the inductor artifacts unless they were loaded from the cache."""
        self.decode_programs, self.decode_reason = decode_programs, reason
        self._graphs_after_warmup = _dynamo_counters()[0]
        if self.settings.enabled and self.route == "jit" and self.artifacts_cache != "hit":
            self.save_cache()

    def _run_sizes(self, run, sizes: list[int]) -> None:
        from tqdm.auto import tqdm

        for n in tqdm(sizes, desc=f"compiling ({self.settings.backend}, {self.settings.scope}, {self.route})",
                      leave=False, disable=None):
            t = time.perf_counter()
            run(n)
            self.compile_seconds[n] = time.perf_counter() - t

    def stats(self) -> dict:
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
            "cache": self.cache,
            "cache_load_seconds": self.load_seconds,
            "compile_seconds": dict(self.compile_seconds),
            "recompiles_after_warmup": recompiles,
            "graph_breaks": breaks,
            "cuda_graphs": cuda_graphs_status(self.factors.get("device", "cpu"), self.settings.mode,
                                              self.settings.enabled, self.decode_programs),
            "decode_programs": {**(self.decode_programs.stats() if self.decode_programs else {"sizes": []}),
                                "reason": self.decode_reason},
        }
