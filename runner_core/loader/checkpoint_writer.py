"""Saves a loaded model as it is stored (quantized or in its compute dtype) as a checkpoint this project loads
again: safetensors under Hugging Face's tensor names, a quantized linear weight as its row-major
`<name>.qweight`, `<name>.scales` (and `<name>.mins` for int4) tensors (layers/quantization.py), config.json
with a `quantization_config` naming the format, and the tokenizer's files.

Fused layers (qkv, gate_up) are split back into the checkpoint's tensors by rows: every format keeps its
scales per output row, so the split is exact. Reading such a checkpoint is `quantized_checkpoint_tensors`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from runner_core.errors import ConfigError, ModelLoadError
from runner_core.layers import quantization as quant
from runner_core.layers.weight_storage import WeightLayer, WeightStorage
from runner_core.models.llama import STACKED_PARAMS, LlamaForCausalLM

QUANT_METHOD = "runner_core"  # quantization_config["quant_method"] of a checkpoint this project wrote
_PARTS = ("qweight", "scales", "mins")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "generation_config.json")


def _hf_names(name: str, module: nn.Module) -> list[tuple[str, int, int]] | None:
    """(checkpoint name prefix, first row, rows) of each tensor a layer's fused weight came from; None for a
    layer that is not fused."""
    fused = name.rsplit(".", 1)[-1]
    shards = [(ckpt, shard) for ckpt, part, shard in STACKED_PARAMS if part == fused]
    if not shards:
        return None
    if hasattr(module, "output_sizes"):
        sizes = module.output_sizes
    else:
        q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
        sizes = [q, kv, kv]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    prefix = name.rsplit(".", 1)[0]
    return [(f"{prefix}.{ckpt}", start, size) for (ckpt, _), start, size in zip(shards, starts, sizes)]


def stored_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of everything `model` holds, its weights as stored (`storage.row_major()`
    of each layer that multiplies one; an embedding sharing a tied head's storage holds nothing of its own)."""
    for name, module in model.named_modules():
        if isinstance(module, WeightStorage):
            continue  # its layer's: read through the layer
        own = dict(module.named_parameters(recurse=False))
        if isinstance(module, WeightLayer) and module.multiplies:
            own.update(module.storage.row_major())
        if not own:
            continue
        parts = _hf_names(name, module)
        if parts is None:
            yield from ((f"{name}.{part}", tensor.contiguous()) for part, tensor in own.items())
            continue
        rows = sum(size for _, _, size in parts)
        for prefix, start, size in parts:
            for part, tensor in own.items():
                yield f"{prefix}.{part}", (tensor.narrow(0, start, size) if tensor.shape[0] == rows else tensor
                                           ).contiguous()


def save_stored(model: nn.Module, hf_config, quantization: dict, tokenizer_dir: Path, directory: str | Path) -> Path:
    """Write `model` (one process's, a Llama-family model) to `directory`; returns its path."""
    if type(model).load_weights is not LlamaForCausalLM.load_weights or any(
            type(m).__name__ == "FusedMoE" for m in model.modules()):
        raise ConfigError(f"save_pretrained writes Llama-family dense models (Llama, Mistral, Qwen2/3); "
                          f"{type(model).__name__} is not one: save the original checkpoint instead")
    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(stored_tensors(model))
    if getattr(hf_config, "tie_word_embeddings", False):
        for name in [n for n in tensors if n.startswith("lm_head.")]:  # the tied head's one copy: the embedding's
            tensors["model.embed_tokens." + name.split(".", 1)[1]] = tensors.pop(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config.to_dict()
    if quantization.get("format"):
        config["quantization_config"] = {"quant_method": QUANT_METHOD, "format": quantization["format"],
                                         "group_size": quantization["group_size"],
                                         "quantize_lm_head": quantization["lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and tokenizer_dir.resolve() != out.resolve():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def checkpoint_quantization(hf_config) -> dict | None:
    """The `quantization_config` of a checkpoint this project quantized, or None; another method's is refused."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != QUANT_METHOD:
        raise ModelLoadError(f"the checkpoint is quantized with {qc.get('quant_method')!r}, which this runner does not "
                             f"read (GPTQ, AWQ and others are out of scope); load its unquantized original and pass "
                             f"quantization='int8' or 'int4'")
    return qc


def quantized_checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A quantized checkpoint's tensors with each `<name>.qweight/.scales/.mins` group given back as
    `<name>.weight` in float32 (dequantized one tensor at a time: the layer quantizes it again as it streams
    in, to the same integers)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        group = pending.setdefault(prefix, {})
        group[part] = tensor
        if "qweight" in group and "scales" in group and (group["qweight"].dtype == torch.int8 or "mins" in group):
            del pending[prefix]
            q = group["qweight"]
            k = q.shape[1] * (1 if q.dtype == torch.int8 else 2)
            fmt = quant.QuantFormat.of("int8") if q.dtype == torch.int8 else \
                quant.QuantFormat.of("int4", k // group["scales"].shape[1])
            yield f"{prefix}.weight", quant.dequantize(group, fmt)
    if pending:
        raise ModelLoadError(f"quantized tensors without their other parts: {', '.join(sorted(pending))[:200]}")
