"""Greedy tokens and logits equal Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from runner_core import ModelRunner, SamplingParams
from tests.helpers import make_tiny_hf_model

CASES = {
    "llama-gqa": dict(family="llama"),
    "llama-tied": dict(family="llama", tie_word_embeddings=True),
    "llama-head-dim": dict(family="llama", head_dim=32),
    "llama3-rope-scaling": dict(family="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": dict(family="mistral"),
    "qwen2-bias": dict(family="qwen2"),
    "qwen3-qk-norm": dict(family="qwen3", head_dim=32),  # explicit head_dim != hidden / heads
    "qwen3-tied": dict(family="qwen3", tie_word_embeddings=True),
}


def _prompts(vocab: int, lengths=(3, 11, 40, 1, 75), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22})
    runner.load_model()
    return hf, runner


def test_forward_logits_close(pair):
    hf, runner = pair
    ids = torch.tensor(_prompts(hf.config.vocab_size, lengths=(24, 24)))
    with torch.no_grad():
        ref = hf(ids).logits
    out = runner.forward(ids)
    assert out["logits"].shape == ref.shape
    torch.testing.assert_close(out["logits"], ref, atol=1e-4, rtol=1e-4)
    assert out["hidden_states"].shape == (2, 24, hf.config.hidden_size)


def test_forward_with_padding_mask(pair):
    hf, runner = pair
    ids = torch.tensor(_prompts(hf.config.vocab_size, lengths=(16, 16)))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding on row 1
    out = runner.forward(ids, attention_mask=mask)["logits"]
    with torch.no_grad():
        ref = hf(ids[1:, 6:]).logits
    torch.testing.assert_close(out[1, 6:], ref[0], atol=1e-4, rtol=1e-4)
    assert out[1, :6].abs().sum() == 0


def test_greedy_tokens_equal_transformers(pair):
    hf, runner = pair
    prompts = _prompts(hf.config.vocab_size)
    outs = runner.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_greedy_stops_at_eos_like_transformers(pair):
    hf, runner = pair
    prompts = _prompts(hf.config.vocab_size, lengths=(5, 9, 30), seed=7)
    outs = runner.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[5, 6, 7, 8]))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                          eos_token_id=[2, 5, 6, 7, 8], pad_token_id=0)[0, len(prompt):].tolist()
        while ref and ref[-1] == 0 and len(ref) > len(out.token_ids):
            ref.pop()
        assert out.token_ids == ref
