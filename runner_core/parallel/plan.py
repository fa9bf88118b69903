"""Which parallel layouts a model allows, and which one to use on given devices.

`validate_parallel_config` refuses, with a `ConfigError` naming the reason, a tensor-parallel
size that does not divide the heads (or the MLP width), a pipeline deeper than the model,
a stage split that does not add up, and a world size larger than the CUDA devices.

`suggest_parallel_config(model, devices)` picks tensor_parallel_size x pipeline_parallel_size
from the memory prediction (`estimate_memory`: weights, activation peak, rotary tables and a
KV pool for `min_sequences` sequences of max_model_len, per device) and the devices' memory.
The rule, in order:
  1. candidates are every (tp, pp) with tp x pp <= the number of devices, tp a valid split of
     the heads and at most `devices_per_node` (TP all-reduces twice per layer: keep it inside
     a node), pp <= the number of layers;
  2. a candidate fits when its per-device need is at most the usable memory of the smallest
     device (CUDA: total x gpu_memory_utilization; CPU: available RAM / number of devices);
  3. the fitting candidate with the fewest devices wins (less communication, devices left
     for other replicas); at equal device count the larger tp wins (TP splits each layer's
     work and KV per token, so it lowers latency; PP without micro-batching runs the stages
     one after another and only adds capacity).
With `storage_formats=True` every layout is also tried with each lighter storage format of the
weights (`memory.fit.storage_ladder`: bfloat16 where the dtype is float32, then int8, then int4
in groups of 32, 64, 128), and the rule ranks by devices first, then by the format's loss of
quality (the ladder's order), then by tp: "1 device with int8" comes before "2 devices in
bfloat16", and "2 devices as configured" before "2 devices in int8". A format costs quality but
no communication; a device more costs hardware and a collective per layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runner_core.errors import ConfigError
from runner_core.memory import ModelShape, available_memory_bytes, estimate_memory, stage_layer_ranges
from runner_core.memory.fit import storage_ladder
from runner_core.models import MODEL_REGISTRY

_GiB = 2**30


def _cuda_devices_needed(config) -> tuple[int, int]:
    """(devices this node's ranks need, devices visible) for a CUDA config."""
    visible = torch.cuda.device_count()
    if os.environ.get("LOCAL_WORLD_SIZE") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["LOCAL_WORLD_SIZE"]), visible  # torchrun: the ranks of this node
    return config.torch_device.index + config.world_size, visible


def validate_parallel_config(config, hf_config) -> list[range]:
    """Refuse a parallel layout the model or the machine cannot take; the layers of each stage."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if getattr(hf_config, "vision_config", None) is not None:
        raise ConfigError(f"{', '.join(hf_config.architectures or [hf_config.model_type])} is multimodal: its vision "
                          "tower runs in one process for now; use tensor_parallel_size=1 and pipeline_parallel_size=1")
    MODEL_REGISTRY.get_adapter(hf_config, config.model_impl, trust_remote_code=config.trust_remote_code,
                               tensor_parallel_size=tp, pipeline_parallel_size=pp)  # the fallback is one device
    shape = ModelShape.from_hf_config(hf_config)
    problem = shape.tp_problem(tp)
    if problem:
        raise ConfigError(problem)
    stages = stage_layer_ranges(shape.num_layers, pp, config.pipeline_stage_layers)
    if config.torch_device.type == "cuda":
        needed, visible = _cuda_devices_needed(config)
        if needed > visible:
            raise ConfigError(
                f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {tp * pp} ranks need one CUDA "
                f"device each (cuda:{config.torch_device.index} onwards, {needed} in all) but {visible} "
                f"{'is' if visible == 1 else 'are'} visible; lower the sizes or use more devices (torchrun for "
                "several nodes)")
    return stages


# ---- suggestion ----------------------------------------------------------------------------
@dataclass
class ParallelSuggestion:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    per_device_bytes: int  # predicted need per device of the choice
    device_bytes: int  # usable memory of the smallest device
    reason: str
    candidates: list[dict] = field(default_factory=list)  # every layout considered, with its need and verdict
    storage: dict = field(default_factory=dict)  # the storage format's settings (dtype, quantization), if changed

    def as_config(self) -> dict:
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size, **self.storage}

    def __str__(self) -> str:
        rows = [f"  tp={c['tp']} pp={c['pp']}" + (f" {c['storage']}" if c.get("storage") else "") + ": "
                + (f"{c['need_bytes'] / _GiB:.2f} GiB per device, "
                f"{'fits' if c['fits'] else 'too big'}" if c.get("need_bytes") is not None else c["why"])
                for c in self.candidates]
        return self.reason + "\n" + "\n".join(rows)


def _usable_bytes(devices, device_memory: int | None, gpu_memory_utilization: float) -> tuple[int, int, str]:
    """(number of devices, usable bytes of the smallest, device kind)."""
    if isinstance(devices, int):
        if devices < 1:
            raise ConfigError(f"devices must be >= 1, got {devices}")
        devices = [f"cuda:{i}" for i in range(devices)] if device_memory is None else ["cuda"] * devices
    devices = [torch.device(d) if not isinstance(d, torch.device) else d for d in devices]
    if not devices:
        raise ConfigError("devices is empty; pass a count or a list of devices")
    kind = devices[0].type
    if device_memory is not None:
        return len(devices), int(device_memory * (gpu_memory_utilization if kind == "cuda" else 1)), kind
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device is visible; pass device_memory=<bytes per device> to plan on paper")
        return len(devices), min(int(torch.cuda.mem_get_info(d)[1] * gpu_memory_utilization) for d in devices), kind
    return len(devices), available_memory_bytes("cpu") // len(devices), kind  # the ranks share the RAM


def _runs_on_one_device(model: str, estimate_kwargs: dict) -> bool:
    """Whether `model` loads through the transformers fallback (one device only)."""
    from runner_core.loader.model_loader import read_hf_config, resolve_model_path

    trust = estimate_kwargs.get("trust_remote_code", False)
    hf_config = read_hf_config(resolve_model_path(str(model), weights=False), trust)
    adapter = MODEL_REGISTRY.get_adapter(hf_config, estimate_kwargs.get("model_impl", "auto"), trust_remote_code=trust)
    return adapter.impl == "transformers"


def suggest_parallel_config(model: str, devices: int | Sequence, *, device_memory: int | None = None,
                            devices_per_node: int | None = None, gpu_memory_utilization: float = 0.9,
                            min_sequences: int = 1, storage_formats: bool = False,
                            **estimate_kwargs) -> ParallelSuggestion:
    """Pick tensor_parallel_size and pipeline_parallel_size for `model` on `devices` (a CUDA count,
    or a list such as ["cuda:0", "cuda:1"] or ["cpu"] * 2) by the rule in the module docstring;
    with `storage_formats`, also the weights' storage format (bfloat16, int8, int4) that lets it
    take fewer devices (`as_config()` then carries the format's settings too).

    `model` is what estimate_memory takes, a config-only model included (planned on paper: no weights);
    `device_memory` (bytes per device) plans on paper instead of asking the devices;
    `estimate_kwargs` go to `estimate_memory` (dtype, max_model_len, max_num_seqs, quantization, ...).
    Raises ConfigError when no layout fits, saying the least memory per device it would take."""
    n, usable, kind = _usable_bytes(devices, device_memory, gpu_memory_utilization)
    per_node = devices_per_node or n
    estimate_kwargs.setdefault("device", "cuda" if kind == "cuda" else "cpu")
    base = estimate_memory(model, **estimate_kwargs)
    shape = base.inputs.shape
    one_device = _runs_on_one_device(model, estimate_kwargs)
    formats = [("", {})] + (storage_ladder(base) if storage_formats else [])
    candidates = []
    for world in range(1, n + 1):
        for tp in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
            pp = world // tp
            why = shape.tp_problem(tp)
            if why is None and one_device and tp * pp > 1:
                why = "the transformers fallback runs on one device (tensor_parallel_size=pipeline_parallel_size=1)"
            if why is None and tp > per_node:
                why = f"tensor_parallel_size={tp} would span nodes (devices_per_node={per_node})"
            if why is None and pp > shape.num_layers:
                why = f"pipeline_parallel_size={pp} exceeds the {shape.num_layers} layers"
            if why is not None:
                candidates.append({"tp": tp, "pp": pp, "need_bytes": None, "fits": False, "why": why})
                continue
            for rank, (label, settings) in enumerate(formats):
                est = estimate_memory(model, **{**estimate_kwargs, **settings, "tensor_parallel_size": tp,
                                                "pipeline_parallel_size": pp})
                need = est.fixed_bytes + est.min_kv_pool_bytes * min_sequences
                candidates.append({"tp": tp, "pp": pp, "need_bytes": need, "fits": need <= usable, "why": "",
                                   **({"storage": label, "settings": settings, "rank": rank} if label else {})})
    fitting = [c for c in candidates if c["fits"]]
    if not fitting:
        sized = [c for c in candidates if c["need_bytes"] is not None]
        best = min(sized, key=lambda c: c["need_bytes"]) if sized else None
        detail = (f"; the best layout, tp={best['tp']} pp={best['pp']}, needs {best['need_bytes'] / _GiB:.2f} GiB "
                  f"per device" if best else "")
        raise ConfigError(f"{model} does not fit on {n} device(s) of {usable / _GiB:.2f} GiB usable{detail}. "
                          "Use more or larger devices, a 16-bit dtype, int8/int4 weights (quantization=, or "
                          "storage_formats=True to let the plan choose) or a shorter max_model_len")
    best = min(fitting, key=lambda c: (c["tp"] * c["pp"], c.get("rank", 0), -c["tp"]))
    smaller = [c for c in candidates if c["tp"] * c["pp"] < best["tp"] * best["pp"] and c["need_bytes"] is not None]
    why_not_fewer = (f"; with fewer devices the least need is {min(c['need_bytes'] for c in smaller) / _GiB:.2f} GiB"
                     if smaller else "")
    storage = (f" with {best['storage']} weights (the least loss of quality that fits them)"
               if best.get("storage") else "")
    reason = (f"tensor_parallel_size={best['tp']}, pipeline_parallel_size={best['pp']}{storage}: the fewest devices "
              f"({best['tp'] * best['pp']} of {n}) whose predicted need per device, "
              f"{best['need_bytes'] / _GiB:.2f} GiB "
              f"(weights, activation peak, rotary tables and KV for {min_sequences} x max_model_len), fits in "
              f"{usable / _GiB:.2f} GiB usable{why_not_fewer}; at equal device count tensor parallelism is "
              "preferred (it splits every layer's work; pipeline stages run one after another)")
    return ParallelSuggestion(best["tp"], best["pp"], best["need_bytes"], usable, reason, candidates,
                              dict(best.get("settings", {})))
