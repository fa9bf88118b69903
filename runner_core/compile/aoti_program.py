"""AOTInductor programs: a module exported with its parameters and buffers as inputs, compiled
into a package in the compile cache, loaded with the C++ package loader and run with checks of
what the package assumes (there are no dynamo guards at run time).

One program serves every target module of a scope (all one class: their tensors are inputs), for
any token count >= 1; with `size`, a static decode program of exactly that many tokens exported
with the layers' prepacked weights (layers/linear.py, decode_programs.py). Why this route and what else
was tried: docs/compile.md; its figures: docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from runner_core.compile.compile_cache import load_verified, locked, vec_isa_list, write_atomic
from runner_core.layers.linear import packed_weights_in_use

logger = logging.getLogger("runner_core")

AOTI_PACKAGE = "aoti.pt2"  # the general program's package
AOTI_META = "aoti.json"
# torch 2.13's inductor deep-copies the exported graph for its repro tooling (_dynamo/repro/
# after_aot.py), and copying a pytree LeafSpec warns that `isinstance(treespec, LeafSpec)` is
# deprecated: a FutureWarning about torch's own code, which a user cannot act on (a notebook shows
# it in pink on every cold compile). `package` ignores exactly that message, only while packaging.
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def package(ep: torch.export.ExportedProgram, path: str, inductor_configs: dict | None) -> None:
    """Compile `ep` into an AOTInductor package at `path` (a name ending in .pt2)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
        torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=inductor_configs)


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
        if any(type(m).__name__ == "FusedMoE" for m in module.modules()) and not any(
                node.target is torch.ops.runner_core.fused_moe.default for node in ep.graph.nodes):
            raise RuntimeError("the experts were traced through instead of kept as the runner_core::fused_moe op")
        folder = self.opt.folder
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{os.getpid()}.{self.package}"  # the packager wants a name ending in .pt2
        try:
            package(ep, str(tmp), self.opt.settings.inductor_configs)
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
