"""Logprobs in the engine against transformers on the same weights: each output token's {token id: logprob}
(the sampled token and the top k) equals transformers' log_softmax of the same logits, the greedy token is the
argmax; prompt logprobs likewise, whole or in chunks, after a preemption, with prefix caching on."""

from __future__ import annotations

import pytest
import torch
import transformers

from runner_core import ModelRunner, SamplingParams
from tests.helpers import make_tiny_hf_model

K = 5


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("logprobs"), family="llama")


@pytest.fixture(scope="module")
def hf(hf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22, **kw}).load_model()


def _prompts(vocab: int, lengths=(2, 13, 40, 75)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax of the logits at every position of `ids`, [len(ids), V]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _assert_entry(entry: dict[int, float], ref: torch.Tensor, token: int, k: int) -> None:
    """`entry` holds `token` and the top `k` of `ref` (one position's logprobs), with their values."""
    top = ref.topk(k).indices.tolist()
    assert set(entry) == {token, *top}
    ids = list(entry)
    torch.testing.assert_close(torch.tensor([entry[i] for i in ids]), ref[ids], atol=1e-4, rtol=1e-4)


def test_sampled_logprobs_equal_transformers_and_greedy_takes_the_argmax(hf, hf_path):
    runner = _runner(hf_path)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=K)
    for prompt, out in zip(prompts, runner.generate(prompts, params)):
        ref = _reference(hf, prompt + out.token_ids)[len(prompt) - 1:-1]
        assert len(out.logprobs) == len(out.token_ids) == 8
        for entry, tok, row in zip(out.logprobs, out.token_ids, ref):
            assert tok == row.argmax().item()
            _assert_entry(entry, row, tok, K)


def test_random_sampling_reports_the_raw_distribution_not_the_tempered_one(hf, hf_path):
    prompt = _prompts(hf.config.vocab_size)[2]
    params = SamplingParams(max_tokens=6, temperature=1.7, top_k=20, seed=3, ignore_eos=True, logprobs=2)
    out = _runner(hf_path).generate(prompt, params)[0]
    ref = _reference(hf, prompt + out.token_ids)[len(prompt) - 1:-1]
    for entry, tok, row in zip(out.logprobs, out.token_ids, ref):
        _assert_entry(entry, row, tok, 2)


CONFIGS = {"whole": {}, "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
           "prefix-cache": {"enable_prefix_caching": True}}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_prompt_logprobs_equal_transformers(hf, hf_path, config):
    runner = _runner(hf_path, **config)
    prompts = _prompts(hf.config.vocab_size)
    if config.get("enable_prefix_caching"):  # the prompts' blocks cached first: prompt logprobs still come whole
        runner.generate(prompts, SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    for prompt, out in zip(prompts, runner.generate(prompts, params)):
        assert out.logprobs is None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        ref = _reference(hf, prompt)
        for entry, tok, row in zip(out.prompt_logprobs[1:], prompt[1:], ref[:-1]):
            _assert_entry(entry, row, tok, 3)


def test_prompt_logprobs_survive_preemption_once_each(hf, hf_path):
    # tokens, layers, K/V, heads, head_dim, float32; 8 blocks: one sequence at max_model_len, far from all four
    bytes_per_block = 16 * 2 * 2 * 2 * 16 * 4
    runner = _runner(hf_path, kv_cache_memory=8 * bytes_per_block, max_model_len=128)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = runner.generate(prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        ref = _reference(hf, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and len(out.logprobs) == 40
        for entry, tok, row in zip(out.prompt_logprobs[1:], prompt[1:], ref[:-1]):
            _assert_entry(entry, row, tok, 0)


def test_no_logprobs_asked_none_returned(hf_path):
    out = _runner(hf_path).generate([5, 6, 7], SamplingParams(max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None
