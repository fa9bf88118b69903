"""ModelLoader: resolves `model` (the catalogue's kinds, then a hub id), reads config.json, builds the
runner's model and streams safetensors weights into it (never pickle), then loads the tokenizer.

Mapping HF names onto fused parameters (qkv, gate_up) and tensor-parallel slicing
are done by the model's `load_weights` and its parameters' weight loaders. With tensor or
pipeline parallelism the tensors are handed out unread (`LazyWeight`): a weight loader's
`narrow` reads only this rank's rows or columns from the file, and tensors of other
pipeline stages are never read.
"""

from __future__ import annotations

import json
import logging
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from runner_core.config import RunnerConfig, resolve_max_model_len
from runner_core.errors import ModelLoadError, UnknownModelError
from runner_core.layers.quantization import QuantFormat
from runner_core.layers.rotary import rotary_positions
from runner_core.layers.weight_storage import (
    finish_storage,
    num_weights,
    panels_apply,
    plan_storage,
    stored_bytes,
    stored_storages,
)
from runner_core.loader.checkpoint_writer import checkpoint_quantization, quantized_checkpoint_tensors
from runner_core.loader.tokenizer import Tokenizer, has_tokenizer_files, load_tokenizer
from runner_core.loader.weight_utils import WINDOW_BYTES, SafetensorsWeights
from runner_core.models import MODEL_REGISTRY, resolve_model
from runner_core.models.registry import MODEL_ATTRIBUTES, ModelAdapter
from runner_core.process_memory import heap_gives_back, trim_heap

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger("runner_core")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    hf_config: PretrainedConfig
    model_path: Path
    load_seconds: float
    weight_bytes: int  # its weights as stored (parameters, panels, quantized tensors; tied ones once)
    buffer_bytes: int  # its other buffers (rotary tables)
    adapter: ModelAdapter  # which class built it, by which path, and why
    bytes_read: int = 0  # checkpoint bytes read from the safetensors files
    quantization: dict | None = None  # the storage format and what it kept in the compute dtype
    processor: object | None = None  # a multimodal model's Hugging Face processor (tokenizer + image processor)


class ModelLoader:
    """Loads `config.model` onto `config.torch_device` in `config.torch_dtype`."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config

    def load(self) -> LoadedModel:
        start = time.perf_counter()
        cfg = self.config
        path = resolve_model_path(cfg.model)
        hf_config = read_hf_config(path, cfg.trust_remote_code)
        adapter = MODEL_REGISTRY.get_adapter(hf_config, cfg.model_impl, trust_remote_code=cfg.trust_remote_code,
                                             tensor_parallel_size=cfg.tensor_parallel_size,
                                             pipeline_parallel_size=cfg.pipeline_parallel_size)
        logger.info("%s: %s adapter %s (%s)", adapter.architecture, adapter.impl, adapter.model_class.__name__,
                    adapter.reason)
        if cfg.dtype == "auto":
            logger.info("dtype auto -> %s: %s", *cfg.auto_dtype())
        # the tokenizer and processor first: they fail fast, before any weight is read
        tokenizer_path = _tokenizer_path(cfg.tokenizer) if cfg.tokenizer else path
        if cfg.tokenizer and not has_tokenizer_files(tokenizer_path):
            raise ModelLoadError(
                f"tokenizer {cfg.tokenizer!r} ({tokenizer_path}) holds no tokenizer files: pass a directory "
                "with tokenizer.json or tokenizer_config.json, or leave tokenizer unset to use the model's"
            )
        tokenizer = load_tokenizer(tokenizer_path, hf_config, cfg.trust_remote_code)
        processor = load_processor(path, cfg.trust_remote_code) if adapter.kind == "multimodal" else None
        # from the build on: the parameters the build makes and the plan drops, the staging, the quantizer's
        # temporaries, each on pages of its own, given back when freed
        with heap_gives_back():
            model = self._build(adapter.model_class, hf_config)
            fmt, lm_head, saved = self._format(hf_config)
            if fmt is not None and adapter.impl != "native":
                raise ModelLoadError(
                    f"quantization={cfg.quantization!r} needs a native adapter; {adapter.architecture} runs on the "
                    f"{adapter.impl} path ({adapter.reason}). Load it without quantization, or register a native "
                    "adapter for it (runner_core.register_model)")
            kept = plan_storage(model, cfg.torch_dtype, panels_apply(cfg.torch_device, cfg.torch_dtype, cfg.world_size),
                                fmt, lm_head)
            try:
                bytes_read = self._load_weights(model, path, saved)
                finish_storage(model)
                if bytes_read >= WINDOW_BYTES:  # the staging and the quantizer's temporaries, back to the system
                    trim_heap()
            except BaseException as exc:
                # a notebook keeps the last traceback: its frames must not hold the half-loaded model
                del model
                traceback.clear_frames(exc.__traceback__)
                raise
        stored = stored_bytes(model)
        weight_bytes = _nbytes(model.parameters()) + stored
        return LoadedModel(model=model, tokenizer=tokenizer, hf_config=hf_config, model_path=path,
                           load_seconds=time.perf_counter() - start, weight_bytes=weight_bytes,
                           buffer_bytes=_nbytes(model.buffers()) - stored, adapter=adapter, bytes_read=bytes_read,
                           quantization=quantization_info(model, fmt, lm_head, cfg.torch_dtype, kept, weight_bytes),
                           processor=processor)

    def _build(self, cls: type, hf_config) -> nn.Module:
        cfg = self.config
        limit = hf_config.get_text_config().max_position_embeddings
        # the rotary table covers the positions a step can reach: max_model_len, or a profile batch's tokens
        reach = max(resolve_max_model_len(cfg.max_model_len, limit), cfg.effective_max_num_batched_tokens)
        positions = min(limit, reach)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(cfg.torch_dtype)
        try:
            with torch.device(cfg.torch_device), rotary_positions(positions):
                model = cls(hf_config)
        except ValueError as exc:  # e.g. heads not divisible by the tensor parallel size
            raise ModelLoadError(
                f"cannot build {cls.__name__} (tensor_parallel_size={self.config.tensor_parallel_size}): {exc}"
            ) from exc
        finally:
            torch.set_default_dtype(previous)
        missing = [a for a in MODEL_ATTRIBUTES if not hasattr(model, a)]
        if missing:
            raise ModelLoadError(f"{cls.__name__} does not set {', '.join(missing)}, which the runner reads (the model "
                                 "contract: see runner_core.register_model)")
        return model.eval()

    def _format(self, hf_config) -> tuple[QuantFormat | None, bool, bool]:
        """(the storage format, whether the LM head takes it, whether the checkpoint was saved quantized): the
        config's, or those a checkpoint this project quantized names in its config.json."""
        cfg = self.config
        saved = checkpoint_quantization(hf_config)
        if saved is None:
            fmt = QuantFormat.of(cfg.quantization, cfg.quantization_group_size) if cfg.quantization else None
            return fmt, cfg.quantize_lm_head, False
        if cfg.quantization not in (None, saved["format"]):
            raise ModelLoadError(f"the checkpoint is stored in {saved['format']}, but quantization="
                                 f"{cfg.quantization!r} was asked; load it with quantization=None (or "
                                 f"{saved['format']!r}), or quantize its unquantized original")
        if cfg.world_size > 1:
            raise ModelLoadError("a checkpoint quantized by runner_core loads in one process; load its unquantized "
                                 "original with tensor or pipeline parallelism and quantization set")
        return QuantFormat.of(saved["format"], saved.get("group_size") or 64), bool(saved["quantize_lm_head"]), True

    def _load_weights(self, model: nn.Module, path: Path, saved_quantized: bool = False) -> int:
        cfg = self.config
        weights = SafetensorsWeights(path, lazy=cfg.world_size > 1)
        stream = quantized_checkpoint_tensors(weights) if saved_quantized else iter(weights)
        try:
            with torch.no_grad():
                loaded = model.load_weights(stream)
        except ValueError as exc:
            if weights.current is None:
                raise ModelLoadError(f"cannot load the weights in {path}: {exc}") from exc
            file, name, shape = weights.current
            raise ModelLoadError(
                f"cannot load tensor {name!r} of shape {shape} from {file}: {exc}. "
                "The checkpoint does not match its config.json"
            ) from exc
        missing = [name for name, _ in model.named_parameters() if name not in loaded]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ModelLoadError(
                f"{len(missing)} parameters of the model were not in the checkpoint {path}: "
                f"{', '.join(missing[:5])}{more}"
            )
        return weights.bytes_read


def quantization_info(model: nn.Module, fmt: QuantFormat | None, lm_head: bool, dtype: torch.dtype,
                      kept: dict[str, str], weight_bytes: int) -> dict:
    """What model_info reports of the storage format: the format, the layers it holds and those kept in
    the compute dtype (with why), and the weights' bytes as stored beside their bytes in the compute dtype."""
    quantized = [s for s in stored_storages(model) if s.fmt is not None]
    groups = sorted({s.fmt.group for s in quantized if s.fmt.name == "int4"})
    dense = num_weights(model)
    return {"format": fmt.name if fmt else None, "group_size": fmt.group if fmt and fmt.group else None,
            "int4_groups": groups, "lm_head": lm_head if fmt else False,
            "quantized_layers": len(quantized), "kept_layers": kept,
            "weights_bytes": weight_bytes, "dense_bytes": dense * dtype.itemsize}


def _nbytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # parameters()/buffers() yield shared ones once


def resolve_model_path(model: str, *, weights: bool = True) -> Path:
    """A local directory for `model`: what the catalogue resolves (a directory holding config.json, a preset,
    and a config-only model unless `weights` are needed: runner_core.models.catalogue), else a hub id from the
    Hugging Face cache (or downloaded)."""
    try:
        return resolve_model(model, weights=weights)
    except UnknownModelError as unknown:
        if not (_HUB_ID.match(model) and not model.startswith(".") and not Path(model).expanduser().exists()):
            raise
        return _from_hf_cache(model, str(unknown))


_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"]  # never pickles


def _from_hf_cache(repo_id: str, unknown: str) -> Path:
    """The snapshot of `repo_id`: from the local Hugging Face cache, else downloaded (safetensors only)
    unless HF_HUB_OFFLINE is set; else UnknownModelError: `unknown` (the catalogue's kinds) and why not."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_HUB_PATTERNS))
    except (OSError, ValueError):
        pass
    reason = "HF_HUB_OFFLINE is set"
    if not constants.HF_HUB_OFFLINE:
        try:
            return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=10))
        except Exception as exc:  # connection, authorisation or missing-repo errors
            reason = f"the hub could not be reached or refused it ({type(exc).__name__})"
    raise UnknownModelError(f"{unknown}; nor a hub id in the Hugging Face cache, and {reason}: fetch it first where "
                            f"the hub is reachable (`hf download {repo_id}`)")


def _tokenizer_path(tokenizer: str) -> Path:
    """The directory of `tokenizer`: a directory as it is (a tokenizer needs no config.json), else a model's."""
    local = Path(tokenizer).expanduser()
    return local if local.is_dir() else resolve_model_path(tokenizer)


def load_processor(path: Path, trust_remote_code: bool = False):
    """The Hugging Face processor of a multimodal model directory (its tokenizer and image processor)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise ModelLoadError(f"cannot load the processor in {path}: {exc}. A multimodal model needs its processor "
                             "files (processor_config.json or preprocessor_config.json, and the tokenizer's); save "
                             "them with processor.save_pretrained(dir)") from exc


def read_hf_config(path: Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The transformers config of the model directory `path`."""
    from transformers import AutoConfig

    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"no config.json in {path}: a model directory needs the Hugging Face config.json")
    try:
        json.loads(file.read_bytes())
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ModelLoadError(f"{file} is not valid JSON ({exc}); restore it from where the checkpoint came from, "
                             "or write it again with config.save_pretrained(dir)") from None
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises ValueError, OSError, KeyError, ...
        raw = _raw_config(path)
        if raw.get("auto_map") and not trust_remote_code:
            archs = ", ".join(raw.get("architectures") or [f"model_type={raw.get('model_type')}"])
            raise ModelLoadError(
                f"architecture {archs!r} is remote code (config.json's auto_map: {raw['auto_map']}), which runs only "
                "with trust_remote_code=True; pass trust_remote_code=True if you trust that code, or use an "
                "architecture listed by runner_core.supported_architectures()") from exc
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc


def _raw_config(path: Path) -> dict:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
