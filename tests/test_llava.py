"""LLaVA on the runner's paged KV cache: greedy tokens and log-probabilities equal transformers' for
several images and prompts in one batch (prefix caching on); both request forms; the encoder cache;
two images behind the same text never share a prefix block; chunked prefill keeps an uncached
image whole; each bad multimodal request fails alone with its message."""

from __future__ import annotations

import pytest
import torch
import transformers

from runner_core import InvalidRequestError, ModelRunner, SamplingParams
from tests.helpers import IMAGE_TOKEN_ID, make_tiny_hf_model, make_tiny_llava, random_image

STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = [  # (text, number of images)
    ("USER: <image> what is in the picture? ASSISTANT:", 1),
    ("USER: compare <image> with <image> please ASSISTANT:", 2),
    ("USER: <image> what is in the picture? ASSISTANT:", 1),  # the first text, another image
    ("USER: no image here ASSISTANT:", 0),
]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(path)
    runner = ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22,
                          "enable_prefix_caching": True, "block_size": 8}).load_model()
    return path, hf, processor, runner


def _requests(seed: int = 0) -> list[dict]:
    out, k = [], seed
    for text, n in PROMPTS:
        images = [random_image(k + i) for i in range(n)]
        k += n
        out.append({"prompt": text, **({"multi_modal_data": {"image": images}} if images else {})})
    return out


def _reference(hf, processor, request) -> tuple[list[int], list[float]]:
    images = request.get("multi_modal_data", {}).get("image")
    inputs = processor(text=[request["prompt"]], images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_batch_of_images_equals_transformers(llava):
    _, hf, processor, runner = llava
    requests = _requests()
    outs = runner.generate(requests, GREEDY)
    for request, out in zip(requests, outs):
        tokens, logprobs = _reference(hf, processor, request)
        assert out.token_ids == tokens, request["prompt"]
        ours = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
    assert runner.model_info()["kind"] == "multimodal"


def test_token_id_prompts_and_repeats_hit_the_encoder_cache(llava):
    """prompt_token_ids with one placeholder per image (expanded by the runner) give the text form's
    tokens; the same images again are served from the encoder cache and the prefix cache."""
    _, _, processor, runner = llava
    request = _requests(seed=20)[1]
    ids = processor.tokenizer(request["prompt"])["input_ids"]
    assert ids.count(IMAGE_TOKEN_ID) == 2
    before = runner.memory_stats()
    by_text = runner.generate(request, GREEDY)[0]
    by_ids = runner.generate({"prompt_token_ids": ids, "multi_modal_data": request["multi_modal_data"]}, GREEDY)[0]
    after = runner.memory_stats()
    assert by_ids.token_ids == by_text.token_ids
    assert after["encoder_cache_misses"] - before["encoder_cache_misses"] == 2  # each image encoded once
    assert by_ids.metrics["num_cached_prompt_tokens"] > 0


def test_same_text_other_image_shares_no_image_block(llava):
    """Requests 0 and 2 share their text; the blocks holding image tokens differ by image hash, so the
    second request reuses only the text before the image (and its own tokens stay right: the parity
    test runs them in one batch)."""
    _, _, _, runner = llava
    first, _, third, _ = _requests(seed=40)
    runner.generate(first, GREEDY)
    out = runner.generate(third, GREEDY)[0]
    prefix = len("USER: ")  # byte-level tokens of the text before the image, plus BOS
    assert out.metrics["num_cached_prompt_tokens"] <= prefix + 1


def test_chunked_prefill_keeps_an_uncached_image_whole(llava):
    """With 12-token chunks a 16-token image cannot split: its chunk waits and then runs the image
    whole; tokens equal the unchunked run."""
    path, hf, processor, _ = llava
    chunked = ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22,
                           "max_num_batched_tokens": 20, "max_num_seqs": 4}).load_model()
    request = _requests(seed=60)[0]
    out = chunked.generate(request, GREEDY)[0]
    assert out.token_ids == _reference(hf, processor, request)[0]
    steps = list(chunked.step_metrics)
    assert all(m.num_prefill_tokens <= 20 for m in steps) and len(steps) > STEPS  # the prompt took several


def test_bad_multimodal_requests_fail_alone(llava, tmp_path):
    _, _, _, runner = llava
    good = _requests(seed=80)[0]
    bad = [
        ({"prompt": "USER: <image> and <image>", "multi_modal_data": {"image": [random_image(1)]}},
         "the prompt has 2 image placeholders (<image>) but 1 image was given"),
        ({"prompt": "USER: <image>", "multi_modal_data": {"image": "/no/such/file.png"}},
         "image 0 is str; give a PIL.Image or a [3, H, W]"),
        ({"prompt": "USER: <image>", "multi_modal_data": {"image": torch.zeros(2, 2)}},
         "image 0 is a tensor of shape (2, 2)"),
        ({"prompt": "USER: <image> hi"}, "holds image placeholders (<image>) but no image"),
        ({"prompt": "hi", "multi_modal_data": {"audio": 1}}, "multi_modal_data must be a dict with the key 'image'"),
        ({"text": "hi"}, "unknown keys ['text']"),
    ]
    outs = runner.generate([good] + [b for b, _ in bad], GREEDY)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == STEPS
    for out, (_, message) in zip(outs[1:], bad):
        assert out.finish_reason == "error" and message in out.error, (out.error, message)
    with pytest.raises(InvalidRequestError, match="image 0 fills 16 tokens but max_num_batched_tokens is 8"):
        small = ModelRunner({"model": str(llava[0]), "dtype": "float32", "kv_cache_memory": 1 << 22,
                             "max_num_batched_tokens": 8, "max_num_seqs": 8}).load_model()
        small.generate(good, GREEDY)
    text_only = ModelRunner({"model": str(make_tiny_hf_model(tmp_path)), "dtype": "float32",
                             "kv_cache_memory": 1 << 22}).load_model()
    with pytest.raises(InvalidRequestError, match=r"this model \(LlamaForCausalLM\) takes text only"):
        text_only.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": [random_image(2)]}}, GREEDY)


def test_memory_estimate_counts_the_vision_tower_and_encoder_cache(llava, tmp_path):
    """Predicted before loading: the weights (vision tower and projector too) equal the loaded ones, the
    encoder cache is its rows of features; a config.json alone (no safetensors) predicts the same."""
    import shutil

    from runner_core import estimate_memory

    path, _, _, runner = llava
    est = estimate_memory(path, dtype="float32", max_model_len=512, encoder_cache_tokens=64)
    weights = runner.memory_stats()["weights_bytes"]  # parameters and the weights stored as panels
    assert est.weights_bytes == weights
    assert est.encoder_cache_bytes == 64 * 64 * 4 and "encoder cache" in str(est)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert estimate_memory(tmp_path, dtype="float32", max_model_len=512, encoder_cache_tokens=64).as_dict() | {
        "model": ""} == est.as_dict() | {"model": ""}


def test_compiled_llava_equals_eager(llava):
    """The image-feature merge is an opaque op: a compiled program (AOTInductor route, layer scope) keeps
    it out of its graph and gives eager's tokens, without recompiling."""
    from tests.test_compile import CACHE_DIR

    path, _, _, runner = llava
    requests = _requests(seed=100)
    eager = [o.token_ids for o in runner.generate(requests, GREEDY)]
    compiled = ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22, "compile": True,
                            "compile_mode": "default", "compile_scope": "layer", "compile_fallback": False,
                            "compile_cache_dir": str(CACHE_DIR)}).load_model()
    assert [o.token_ids for o in compiled.generate(requests, GREEDY)] == eager
    stats = compiled.compile_stats()
    assert stats["warm_start"] == "aoti" and stats["recompiles_after_warmup"] == 0


def test_tiny_llava_preset_runs_with_its_processor():
    """The built-in preset is a LLaVA directory with a processor: it loads by name and its greedy tokens
    equal transformers' on the same directory."""
    runner = ModelRunner({"model": "tiny-llava", "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    path = runner.model_info()["model_path"]
    assert runner.model_info()["kind"] == "multimodal"
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(path)
    request = {"prompt": "USER: <image> what is it? ASSISTANT:", "multi_modal_data": {"image": random_image(3)}}
    out = runner.generate([request], GREEDY)[0]
    assert out.token_ids == _reference(hf, processor, request)[0]
