"""The benchmarks' derived figures are what they say: the workload's FLOPs behind every MFU figure
(benchmarks/machine.py) against torch's FLOP counter on transformers' model."""

from __future__ import annotations

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.machine import decode_weight_bytes, workload_flops
from runner_core.memory.shapes import ModelShape
from runner_core.model_loader import read_hf_config


def test_workload_flops_equal_the_flop_counter_on_transformers(tiny_llama_path):
    """Without attention, the workload's FLOPs are the weight matmuls transformers runs for it: each
    request's prompt and outputs but the last through the layers, the LM head once per output."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    requests = [(5, 3), (12, 1), (1, 6)]
    counted = 0
    for prompt, out in requests:
        ids = torch.randint(3, 500, (1, prompt + out - 1))
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(ids, logits_to_keep=out)
        counts = counter.get_flop_counts()["Global"]
        counted += sum(n for op, n in counts.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    shape = ModelShape.from_hf_config(read_hf_config(tiny_llama_path))
    assert workload_flops(shape, requests, attention=False) == counted
    # attention adds QK^T and PV over each causal (query, key) pair: 4 x layers x heads x head_dim each
    pairs = sum((p + o - 1) * (p + o) // 2 for p, o in requests)
    extra = workload_flops(shape, requests) - counted
    assert extra == 4 * shape.num_layers * shape.num_heads * shape.head_dim * pairs


def test_decode_weight_bytes_are_the_weights_but_the_input_embedding(tiny_llama_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    shape = ModelShape.from_hf_config(read_hf_config(tiny_llama_path))
    total = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert decode_weight_bytes(shape, "float32") == 4 * total
    assert decode_weight_bytes(shape, "bfloat16") == 2 * total
