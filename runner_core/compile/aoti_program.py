"""AOTInductor programs: a module exported with its parameters and buffers as inputs, compiled
into a package in the compile cache, loaded with the C++ package loader and run with checks of
what the package assumes (there are no dynamo guards at run time).

One program serves every target module of a scope (all one class: their tensors are inputs), for
any token count >= 1; with `size`, a static decode program of exactly that many tokens exported
with the layers' prepacked weights (layers/linear.py, decode_programs.py).

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
    sides, so compiled decode is ~1.1x eager here (1.08-1.14x), short of the 1.3x target.
  * Inductor's `freezing` (weights as constants), re-measured (ms per forward, N = 1 / 8 / 32;
    eager 10.3 / 13.3 / 20.1): jit route, static N, 7.2 / 15.1 / 22.0; AOTInductor, static N,
    8.6 / 9.9 / 16.9; AOTInductor, dynamic N, 10.2 / - / 17.9. The N=1 gain of the jit route is
    MKL's packed GEMM, which inductor uses only for a static batch size and never in AOT mode (the
    packed buffer cannot move); a static N=1 package whose layers call it on weights packed at
    load (passed as inputs) ran at 7.0 ms and warm-starts as a package load: that is
    decode_programs.py. A jit-route frozen program warm-started in 7.6 s (dynamo traces, and its
    FX graph is not in the mega-cache), and it makes the KV pool a constant unless passed as input.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from runner_core.compile.compile_cache import load_verified, locked, vec_isa_list, write_atomic
from runner_core.layers.linear import packed_weights_in_use

logger = logging.getLogger("runner_core")

AOTI_PACKAGE = "aoti.pt2"  # the general program's package
AOTI_META = "aoti.json"


class Functional(nn.Module):
    """`module` with its parameters and buffers as inputs: forward(tensors, args)."""

    def __init__(self, module: nn.Module, names: list[str]):
        super().__init__()
        self.__dict__["_target"] = module  # not a submodule: its tensors must not become constants
        self.names = names

    def forward(self, tensors: list, args: list):
        return torch.func.functional_call(self._target, dict(zip(self.names, tensors)), tuple(args))


def tensor_names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]


def tensor_refs(module: nn.Module, names: list[str]) -> list[tuple[dict, str]]:
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
def eager_hooks_off(module: nn.Module):
    """Trace the eager forward: compiled hooks of `module` and its submodules off meanwhile."""
    hooks = {m: m._compiled_call_impl for m in module.modules() if m._compiled_call_impl is not None}
    for m in hooks:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, hook in hooks.items():
            m._compiled_call_impl = hook


class AOTIProgram:
    """One AOTInductor package serving every target module of the scope (all one class), for any
    token count >= 1, or, with `size`, a static decode program of exactly `size` tokens exported
    with the layers' prepacked weights (layers/linear.py)."""

    def __init__(self, optimizer, size: int | None = None):
        """`optimizer`: the CompileOptimizer whose key, folder, settings and factors it uses."""
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
        names = tensor_names(module)
        tensors = [t for _, t in list(module.named_parameters()) + list(module.named_buffers())]
        tensor_dims = [{2: torch.export.Dim.DYNAMIC} if name.endswith("kv_cache") and t.dim() == 4 else None
                       for name, t in zip(names, tensors)]
        if self.size is None:
            # an example with N >= 2, so N is not specialised to 1 (one program serves every N)
            example = [a if n >= 2 else torch.cat([a, a]) for a in args]
            arg_dims, packed = [{0: torch.export.Dim("tokens", min=1)}] * len(example), nullcontext()
        else:
            example, arg_dims, packed = list(args), [None] * len(args), packed_weights_in_use()
        with eager_hooks_off(module), packed:
            ep = torch.export.export(Functional(module, names), (tensors, example),
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
                "vec_isa": vec_isa_list(), "factors": self.opt.factors, "created": time.time()}
        with locked(self.opt.cache_dir / f"{self.opt.key}.lock"):
            os.replace(tmp, folder / self.package)
            write_atomic(folder / self.meta_name, json.dumps(meta, indent=1).encode())
        self.load(folder / self.package, meta)

    def load_cached(self) -> str:
        """Load this program's package from the key's folder if present and intact: hit, miss or rebuilt."""
        opt = self.opt
        status, seconds = load_verified(opt.cache_dir, opt.key, opt.factors, "package", self.package, self.meta_name,
                                        lambda data, info: self.load(opt.folder / self.package, info))
        opt.load_seconds += seconds
        return status

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


class AOTICall:
    """Installed as a target's `_compiled_call_impl`: runs the package with the target's own
    tensors (the first call builds the package when the cache missed)."""

    __slots__ = ("module", "program", "refs")

    def __init__(self, module: nn.Module, program: AOTIProgram):
        self.module, self.program, self.refs = module, program, None

    def __call__(self, *args, **kwargs):
        p = self.program
        if p.loader is None:
            p.build(self.module, args, kwargs)
        if self.refs is None:
            self.refs = tensor_refs(self.module, p.names)
        if kwargs or not p.matches(args):
            return p.miss(self.module, args, kwargs)
        out = p.loader.boxed_run([*[store[k] for store, k in self.refs], *args])
        return out[0] if p.out_kind == "tensor" else tuple(out)
