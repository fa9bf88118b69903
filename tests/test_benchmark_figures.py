"""The benchmarks' derived figures are what they say: the workload's FLOPs behind every MFU figure
(benchmarks/machine.py), attention included, against torch's FLOP counter on transformers' model; `vllm bench
serve`'s figures are of the prompt and output lengths asked (benchmarks/serve.py reads them back)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import serve
from benchmarks.machine import decode_weight_bytes, workload_flops
from runner_core.loader.model_loader import read_hf_config
from runner_core.memory.shapes import ModelShape


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


def _vllm_result(tmp_path, input_lens, output_lens, **extra):
    """A result file as `vllm bench serve --save-result` writes it (the fields serve.py reads)."""
    data = {"completed": len(input_lens), "failed": 0, "output_throughput": 290.0, "median_ttft_ms": 250.0,
            "p99_ttft_ms": 300.0, "median_tpot_ms": 23.0, "p99_tpot_ms": 27.0, "input_lens": input_lens,
            "output_lens": output_lens, **extra}
    path = tmp_path / "vllm-bench-0.json"
    path.write_text(json.dumps(data))
    return path


def test_the_lengths_vllm_bench_serve_sent_are_read_back_and_held_to_what_was_asked(tmp_path):
    args = serve.parse_args(["--num-prompts", "4", "--input-len", "128", "--output-len", "64"])
    figures = serve.read_vllm_result(_vllm_result(tmp_path, [128, 127, 129, 128], [64] * 4), args)
    assert figures["output_throughput"] == 290.0 and figures["tpot_p99_ms"] == 27.0
    assert figures["input_lens"] == {"min": 127, "median": 128, "max": 129}
    assert figures["output_lens"] == {"min": 64, "median": 64, "max": 64}
    # random-range-ratio read as [ratio x len, len] by another vLLM: prompts of 1-128 tokens, not 128
    with pytest.raises(RuntimeError, match=r"input_lens: 2 of 4 differ from the 128 asked by more than 5% "
                                           r"\(range 17-128\).*another workload"):
        serve.read_vllm_result(_vllm_result(tmp_path, [17, 128, 128, 90], [64] * 4), args)
    with pytest.raises(RuntimeError, match="output_lens: 1 of 4 differ from the 64 asked"):
        serve.read_vllm_result(_vllm_result(tmp_path, [128] * 4, [64, 64, 64, 12]), args)
    with pytest.raises(RuntimeError, match="has 3 input_lens for 4 requests"):
        serve.read_vllm_result(_vllm_result(tmp_path, [128] * 3, [64] * 4), args)
    path = _vllm_result(tmp_path, [128] * 4, [64] * 4)
    data = json.loads(path.read_text())
    del data["input_lens"]
    path.write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="has no input_lens for 4 requests: the lengths it sent cannot be checked"):
        serve.read_vllm_result(path, args)
    with pytest.raises(RuntimeError, match="2 requests failed"):
        serve.read_vllm_result(_vllm_result(tmp_path, [128] * 4, [64] * 4, failed=2), args)
