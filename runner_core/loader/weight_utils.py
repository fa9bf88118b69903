"""Reading checkpoint files: the safetensors files of a model directory (never pickle), one tensor at a time.

`SafetensorsWeights` hands out (name, tensor) pairs; tensor or pipeline parallel ranks get `LazyWeight`s
that read only the slice a weight loader narrows to. A file's mapping is closed and reopened after every
`WINDOW_BYTES` read (and the freed heap given back), so the pages of tensors already consumed do not stay
resident while the rest streams in: the peak of a load stays near what the model holds at the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from runner_core.errors import ModelLoadError
from runner_core.process_memory import trim_heap
from runner_core.progress import progress

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
WINDOW_BYTES = 128 << 20  # checkpoint bytes read through one mapping of a file


class SafetensorsWeights:
    """(hf_name, tensor) pairs from a directory's safetensors files, one tensor at a time.

    With `lazy`, the tensors are `LazyWeight`s read on use (only the slice a weight loader
    narrows to). `current` is (file, name, shape) of the last tensor handed out, for error
    messages; `bytes_read` counts what was read.
    """

    def __init__(self, path: Path, lazy: bool = False) -> None:
        self.files = safetensors_files(path)
        self.lazy = lazy
        self.current: tuple[Path, str, tuple[int, ...]] | None = None
        self.bytes_read = 0

    def num_tensors(self) -> int:
        """Tensors in the checkpoint (read from the files' headers)."""
        total = 0
        for file in self.files:
            with _guard(file), safe_open(file, framework="pt", device="cpu") as handle:
                total += len(handle.keys())
        return total

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        files = f"{len(self.files)} file{'s' * (len(self.files) != 1)}"
        with progress(desc=f"Loading weights ({files})", total=self.num_tensors(), unit="tensor", leave=False) as bar:
            yield from self._tensors(bar)

    def _tensors(self, bar) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with _guard(file):
                names = list(safe_open(file, framework="pt", device="cpu").keys())
            while names:
                names = yield from self._window(file, names, bar)

    def _window(self, file: Path, names: list[str], bar) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors `names` of `file` through one mapping, until WINDOW_BYTES are read (never for lazy
        tensors, which read when used); returns the names left."""
        with _guard(file):
            handle = safe_open(file, framework="pt", device="cpu")
        read = 0
        with handle:
            for i, name in enumerate(names):
                if read >= WINDOW_BYTES and not self.lazy:
                    trim_heap()  # the staging freed so far, before the next window maps
                    return names[i:]
                if self.lazy:
                    with _guard(file):
                        part = handle.get_slice(name)
                    tensor = LazyWeight(part, file, self)
                else:
                    with _guard(file):
                        tensor = handle.get_tensor(name)
                    nbytes = tensor.numel() * tensor.element_size()
                    self.bytes_read += nbytes
                    read += nbytes
                self.current = (file, name, tuple(tensor.shape))
                yield name, tensor
                bar.update(1)
        return []


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class LazyWeight:
    """A checkpoint tensor not read yet. `narrow(dim, start, length)` (what the tensor-parallel
    weight loaders call) selects a slice without reading; `to(dtype)` records the target dtype;
    any torch operation on it (e.g. `param.copy_(w)`) reads the selected slice then, through
    the `__torch_function__` protocol. So each rank reads only its shard from the file."""

    __slots__ = ("_part", "_file", "_owner", "_index", "shape", "_dtype")

    def __init__(self, part, file: Path, owner: SafetensorsWeights, index: tuple[slice, ...] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self._part, self._file, self._owner = part, file, owner
        full = part.get_shape()
        self._index = index if index is not None else tuple(slice(0, n) for n in full)
        self.shape = torch.Size(s.stop - s.start for s in self._index)
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype or _SAFETENSORS_DTYPES.get(self._part.get_dtype(), torch.float32)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside a tensor of shape {tuple(self.shape)}")
        base = self._index[dim].start
        index = self._index[:dim] + (slice(base + start, base + start + length),) + self._index[dim + 1:]
        return LazyWeight(self._part, self._file, self._owner, index, self._dtype)

    def to(self, dtype: torch.dtype) -> LazyWeight:
        return LazyWeight(self._part, self._file, self._owner, self._index, dtype)

    def materialize(self) -> torch.Tensor:
        with _guard(self._file):
            tensor = self._part[self._index] if self._index else self._part[:]
        self._owner.bytes_read += tensor.numel() * tensor.element_size()
        return tensor if self._dtype is None else tensor.to(self._dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.materialize() if isinstance(x, LazyWeight) else x
        return func(*map(real, args), **{k: real(v) for k, v in (kwargs or {}).items()})


@contextmanager
def _guard(file: Path) -> Iterator[None]:
    """Turn safetensors' errors on `file` (bad header, short data) into ModelLoadError."""
    try:
        yield
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(
            f"safetensors file {file} is corrupt or truncated ({exc}); download or save it again"
        ) from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the sharded index's, model.safetensors, or any *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid index (a JSON object with a 'weight_map'): {exc}") from exc
        files = [path / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(absent)}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles)}), which are refused for safety "
            "(unpickling can run arbitrary code). Convert once where you trust the file: "
            "transformers.AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"no safetensors weights (*.safetensors) in {path}")
