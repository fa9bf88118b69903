"""What int8 and int4 weights cost in quality against float32 (runner_core.quality), and that the loaded
quantized model computes exactly the model its quantized weights stand for.

Bounds are taken from measurements on this project's presets (2026-12-02, benchmarks/quant.py), each with
its reason; they hold on every kernel tier because the exactness test pins the kernels to the math.
"""

from __future__ import annotations

import pytest
import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.layers.quantization import QuantFormat, dequantize, quantize
from runner_core.layers.weight_storage import layer_format
from runner_core.model_loader import resolve_model_path
from runner_core.quality import greedy_agreement, held_out_paragraphs, logit_error, perplexity, token_windows

FORMATS = {"int8": {"quantization": "int8"}, "int4": {"quantization": "int4", "quantization_group_size": 64}}
PROMPT_LEN, STEPS = 24, 24
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def _load(model: str, fmt: str | None) -> ModelRunner:
    return ModelRunner({"model": model, "dtype": "float32", **FORMATS.get(fmt, {})}).load_model()


@pytest.fixture(scope="module")
def small_llama():
    """small-llama (random weights, 31.6M) in float32 and in each format, with fixed random prompts."""
    runners = {fmt: _load("small-llama", fmt) for fmt in (None, *FORMATS)}
    prompts = torch.randint(3, 8192, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    yield runners, prompts
    for runner in runners.values():
        runner.shutdown()


def _forward(runner: ModelRunner):
    return lambda ids: runner.forward(ids)["logits"]


# Measured on small-llama (4 prompts of 24 random ids; reference mean |logit| 0.90):
#   int8: max 0.34-0.43, mean 0.048-0.050, agreement 0.84-0.88 of next tokens
#   int4 g64: max 3.7-3.9, mean 0.52-0.53, agreement 0.14-0.19
# A random-weight model's logits are nearly flat (its top tokens nearly tied), so one rounding step moves its
# argmax: agreement is low there; tiny-speaker's perplexity below is the figure that means something. The
# bounds are about 2x the measured error (int4's step is ~11x int8's: 16 levels over a group's range against
# 255 over a row's) and agreement well above chance (1 in 8192), so a wrong scale, group or nibble order fails.
LOGIT_BOUNDS = {"int8": {"max": 1.0, "mean": 0.1, "agree": 0.6}, "int4": {"max": 8.0, "mean": 1.0, "agree": 0.05}}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_logit_error_and_greedy_agreement_against_float32(small_llama, fmt):
    runners, prompts = small_llama
    ref = runners[None]
    ref_tokens = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    ids = torch.tensor(prompts)
    err = logit_error(_forward(runners[fmt])(ids), _forward(ref)(ids))
    agree = greedy_agreement(_forward(runners[fmt]), prompts, ref_tokens)
    bound = LOGIT_BOUNDS[fmt]
    assert 0 < err["mean"] <= bound["mean"] and err["max"] <= bound["max"], (fmt, err)
    assert agree["fraction"] >= bound["agree"], (fmt, agree)
    assert runners[fmt].model_info()["quantization"]["format"] == fmt


@pytest.fixture(scope="module")
def hf_small_llama():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("small-llama"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS is a token like any other, as with ignore_eos
    return model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_model_equals_transformers_on_the_dequantized_weights(small_llama, hf_small_llama, fmt):
    """The kernels dequantize in registers; the same weights dequantized in memory (layers/quantization.py's
    reference math, each layer in the format it is stored in) and run by transformers give the same tokens."""
    runners, prompts = small_llama
    runner = runners[fmt]
    info = runner.model_info()["quantization"]
    qfmt = QuantFormat.of(fmt, 64)
    model = hf_small_llama
    originals = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in info["kept_layers"]:
                originals[name] = module.weight.detach().clone()
                stored = layer_format(qfmt, module.in_features)
                module.weight.copy_(dequantize(quantize(module.weight, stored), stored))
        try:
            expected = model.generate(torch.tensor(prompts), max_new_tokens=STEPS, do_sample=False)[:, PROMPT_LEN:]
        finally:
            for name, weight in originals.items():
                model.get_submodule(name).weight.copy_(weight)
    assert set(info["kept_layers"]) == {"lm_head"} and len(originals) == 8 * 7  # every decoder linear
    assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == expected.tolist()


# Measured on tiny-speaker over held-out prose against float32 (60 and 400 paragraphs): int8 -0.05% and -0.04%,
# int4 g64 +0.86% and +0.59% (g32 +0.58%, g128 +0.44%, g64 with the LM head +1.8% on 400). The bounds are issue
# 23's targets: int8 within 1%, int4 within 5%.
PERPLEXITY_BOUNDS = {"int8": 0.01, "int4": 0.05}


def test_tiny_speaker_perplexity_on_held_out_prose():
    texts = held_out_paragraphs(120)
    ppl = {}
    for fmt in (None, *FORMATS):
        runner = _load("tiny-speaker", fmt)
        ppl[fmt] = perplexity(_forward(runner), token_windows(runner.tokenizer.hf, texts))
        runner.shutdown()
    assert 1 < ppl[None] < 500, ppl  # a trained model on text it never saw: well below the 2048-token vocabulary
    for fmt, bound in PERPLEXITY_BOUNDS.items():
        assert abs(ppl[fmt] / ppl[None] - 1) <= bound, (fmt, ppl)
