"""The benchmarks' derived figures are what they say: the workload's FLOPs behind every MFU figure
(benchmarks/machine.py), attention included, against torch's FLOP counter on transformers' model."""

from __future__ import annotations

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.machine import decode_weight_bytes, workload_flops
from runner_core.memory.shapes import ModelShape
from runner_core.model_loader import read_hf_config


def test_workload_flops_equal_the_flop_counter_on_transformers(tiny_llama_path):
    """The workload's FLOPs are the matmuls transformers runs for it, counted by torch's FLOP counter:
    each request's prompt and outputs but the last fed one token at a time through a KV cache (so
    attention does exactly the causal work, QK^T and PV over the keys so far, as eager bmm calls in
    each self_attn module), the LM head only on the positions whose logits give an output."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_path, dtype=torch.float32, attn_implementation="eager").eval()
    requests = [(5, 3), (12, 1), (1, 6)]
    weights = attention = 0
    for prompt, out in requests:
        ids = torch.randint(3, 500, (1, prompt + out - 1))
        cache = transformers.DynamicCache(config=model.config)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            for p in range(ids.shape[1]):  # positions before prompt - 1 give no output: no LM head
                (model if p >= prompt - 1 else model.model)(ids[:, p:p + 1], past_key_values=cache, use_cache=True)
        counts = counter.get_flop_counts()
        weights += sum(n for op, n in counts["Global"].items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
        attention += sum(n for module, ops in counts.items() if module.endswith(".self_attn")
                         for op, n in ops.items() if op is torch.ops.aten.bmm)
    shape = ModelShape.from_hf_config(read_hf_config(tiny_llama_path))
    assert attention > 0
    assert workload_flops(shape, requests, attention=False) == weights
    assert workload_flops(shape, requests) == weights + attention


def test_decode_weight_bytes_are_the_weights_but_the_input_embedding(tiny_llama_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    shape = ModelShape.from_hf_config(read_hf_config(tiny_llama_path))
    total = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert decode_weight_bytes(shape, "float32") == 4 * total
    assert decode_weight_bytes(shape, "bfloat16") == 2 * total
