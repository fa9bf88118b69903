"""The transformers fallback: Hugging Face causal LMs without a native adapter run on the runner's
paged KV cache. Greedy tokens equal transformers' and logits are close for GPT-NeoX, Phi, GPT-2,
OPT and Gemma (none Llama-family); batching, chunked prefill and prefix caching keep the tokens;
a uniform sliding window is honoured; `model_impl` choices and reasons; the memory estimate; the
compiled model ("model" scope); every refusal by its message."""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

import runner_core
from runner_core import CompileError, ConfigError, ModelLoadError, ModelRunner, SamplingParams, estimate_memory
from runner_core.models.transformers_backend import TransformersForCausalLM
from tests.conftest import REPO

INIT = 0.15  # as tests/helpers.py: logits spread enough that greedy choices are far from fp32 noise
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
_COMMON = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=INIT)
ARCHS = {
    # parallel residual, partial rotary (rotary_pct), LayerNorm with biases, head saved as embed_out
    "gpt_neox": (transformers.GPTNeoXConfig, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.5)),
    # parallel attention + MLP, partial rotary, GQA, LM head with a bias
    "phi": (transformers.PhiConfig, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         partial_rotary_factor=0.5)),
    # learned absolute positions, Conv1D projections, tied embeddings
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    # learned positions with an offset of 2, ReLU, queries pre-scaled (attention scaling 1.0)
    "opt": (transformers.OPTConfig, dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                         max_position_embeddings=512, word_embed_proj_dim=64)),
    # GeGLU, (1 + w) RMSNorm, scaled embeddings, explicit head_dim
    "gemma": (transformers.GemmaConfig, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             max_position_embeddings=512)),
}
_NORM = re.compile(r"norm|(^|\.)ln_")


def make_hf_model(tmp_path: Path, config: transformers.PretrainedConfig, seed: int = 0) -> Path:
    """Save a random model of `config` (safetensors) with its biases and norm weights randomised too,
    so a dropped or misnamed weight cannot pass a parity test."""
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32).eval()
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT)
            elif _NORM.search(name):
                param.normal_(1.0, 0.1)
    out = Path(tempfile.mkdtemp(prefix=f"tiny-{config.model_type}-", dir=tmp_path))
    model.save_pretrained(out)
    return out


def make_arch(tmp_path: Path, arch: str, **overrides) -> Path:
    config_cls, fields = ARCHS[arch]
    return make_hf_model(tmp_path, config_cls(**{**_COMMON, **fields, **overrides}))


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22, **kw}).load_model()


def _prompts(lengths=(3, 11, 40, 1, 75), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf, prompt, n=24) -> list[int]:
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()


# ---- parity with transformers --------------------------------------------------------------
@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    path = make_arch(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, _runner(path)


def test_runs_through_the_fallback(pair):
    hf, runner = pair
    info = runner.model_info()
    assert (info["architecture"], info["model_impl"], info["kind"], info["model_class"]) == (
        type(hf).__name__, "transformers", "causal_lm", "TransformersForCausalLM")
    assert info["reason"] == (f"auto: no native adapter for {type(hf).__name__}; transformers class "
                              f"{type(hf).__name__} declares _supports_attention_backend")
    assert info["num_parameters"] == sum(p.numel() for p in hf.parameters())
    assert runner_core.supported_architectures()[type(hf).__name__] == "transformers"


def test_forward_logits_close(pair):
    hf, runner = pair
    ids = torch.tensor(_prompts(lengths=(24, 24)))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(runner.forward(ids)["logits"], ref, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers(pair):
    hf, runner = pair
    prompts = _prompts()
    outs = runner.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p) for p in prompts]


# ---- the engine's batching on a fallback model -------------------------------------------------
@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    path = make_arch(tmp_path_factory.mktemp("neox"), "gpt_neox")
    prefix = _prompts(lengths=(32,), seed=9)[0]
    prompts = _prompts(lengths=(5, 60, 1, 33, 17, 80), seed=4) + [prefix + p for p in _prompts((3, 20, 9), seed=5)]
    one = _runner(path)
    return path, prompts, [one.generate(p, GREEDY)[0].token_ids for p in prompts]


def test_batched_equals_one_at_a_time(neox):
    path, prompts, expected = neox
    assert [o.token_ids for o in _runner(path).generate(prompts, GREEDY)] == expected


def test_chunked_prefill_keeps_tokens(neox):
    path, prompts, expected = neox
    runner = _runner(path, max_num_batched_tokens=8, max_num_seqs=4)
    assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == expected
    assert max(m.num_prefill_tokens + m.num_decode_tokens for m in runner.step_metrics) <= 8


def test_prefix_caching_keeps_tokens(neox):
    path, prompts, expected = neox
    runner = _runner(path, enable_prefix_caching=True)
    outs = [runner.generate(p, GREEDY)[0] for p in prompts]  # one after another: later ones hit the cache
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_cached_prompt_tokens"] for o in outs[-3:]) >= 2 * 32
    assert runner.memory_stats()["prefix_cache_hit_rate"] > 0


def test_uniform_sliding_window_is_honoured(tmp_path):
    """Mistral with an 8-token window through the fallback: prompts longer than the window."""
    from tests.helpers import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, "mistral", sliding_window=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = _runner(path, model_impl="transformers")
    assert runner.model.sliding_window == 8
    prompts = _prompts(lengths=(3, 20, 40))
    assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == [_hf_greedy(hf, p) for p in prompts]


# ---- model_impl -------------------------------------------------------------------------
def test_model_impl_transformers_on_a_native_architecture(tiny_llama_path):
    native, fallback = _runner(tiny_llama_path), _runner(tiny_llama_path, model_impl="transformers")
    info = fallback.model_info()
    assert (info["architecture"], info["model_impl"], info["model_class"]) == (
        "LlamaForCausalLM", "transformers", "TransformersForCausalLM")
    assert info["reason"] == ("model_impl='transformers'; transformers class LlamaForCausalLM declares "
                              "_supports_attention_backend")
    assert native.model_info()["model_impl"] == "native"
    prompts = _prompts()
    assert [o.token_ids for o in fallback.generate(prompts, GREEDY)] == \
        [o.token_ids for o in native.generate(prompts, GREEDY)]


def test_model_impl_native_without_a_native_adapter(neox):
    with pytest.raises(ModelLoadError, match=r"architecture 'GPTNeoXForCausalLM' has no native adapter \(native: "
                                             r".*LlamaForCausalLM.*\); use model_impl='auto' or 'transformers'"):
        _runner(neox[0], model_impl="native")


def test_supported_architectures_lists_both_paths():
    archs = runner_core.supported_architectures()
    assert archs["LlamaForCausalLM"] == "native" and archs["Qwen3ForCausalLM"] == "native"
    assert {archs[a] for a in ("GPTNeoXForCausalLM", "PhiForCausalLM", "GPT2LMHeadModel", "GemmaForCausalLM")} == {
        "transformers"}
    assert "StableLmForCausalLM" not in archs and "FalconForCausalLM" not in archs  # no _supports_attention_backend


def test_memory_estimate_matches_the_loaded_fallback(tmp_path):
    path = make_arch(tmp_path, "gpt2")  # n_inner unset (4 x hidden), tied embeddings, attribute_map names
    runner = _runner(path)
    est = estimate_memory(path, dtype="float32", kv_cache_memory=1 << 22)
    assert est.weights_bytes == runner.model_info()["weights_bytes"]
    assert est.kv_bytes_per_token == runner.memory_stats()["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 4


# ---- compile ----------------------------------------------------------------------------
def test_compiled_fallback_equals_eager(neox):
    path, prompts, expected = neox
    runner = _runner(path, compile=True, compile_backend="inductor", compile_mode="default", compile_scope="model",
                     compile_cache_dir=str(REPO / "test-output" / "compile-cache"), compile_sizes=[1],
                     compile_fallback=False)
    stats = runner.compile_stats()
    assert (stats["enabled"], stats["scope"], stats["warm_start"], stats["graph_breaks"]) == (
        True, "model", "aoti", 0)
    assert stats["decode_programs"]["sizes"] == [1]
    assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == expected
    assert runner.compile_stats()["recompiles_after_warmup"] == 0
    with pytest.raises(CompileError, match="TransformersForCausalLM compiles with compile_scope 'model' only, not "
                                           "'layer'; use compile_scope='model'"):
        runner.set_compile_mode(True, scope="layer")


# ---- refusals ---------------------------------------------------------------------------
def test_class_without_attention_backend_is_refused(tmp_path):
    config = transformers.StableLmConfig(**_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=512)
    path = make_hf_model(tmp_path, config)
    with pytest.raises(ModelLoadError, match=r"architecture 'StableLmForCausalLM' cannot run through the "
                                             r"transformers fallback: its transformers class StableLmForCausalLM "
                                             r"does not declare _supports_attention_backend.*use a native adapter "
                                             r"\(runner_core.register_model\)"):
        _runner(path)


def _edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


def test_remote_code_needs_trust_remote_code(tmp_path, monkeypatch):
    path = make_arch(tmp_path, "phi")
    (path / "modeling_my.py").write_text("from transformers import PhiForCausalLM\n\n\n"
                                         "class MyPhiForCausalLM(PhiForCausalLM):\n    pass\n")
    _edit_config(path, architectures=["MyPhiForCausalLM"],
                 auto_map={"AutoModelForCausalLM": "modeling_my.MyPhiForCausalLM"})
    with pytest.raises(ModelLoadError, match=r"architecture 'MyPhiForCausalLM' is remote code \(config.json's "
                                             r"auto_map: AutoModelForCausalLM -> 'modeling_my.MyPhiForCausalLM'\), "
                                             r"which runs only with trust_remote_code=True"):
        _runner(path)
    # trusted: the remote class runs through the fallback (its module copied into a private cache)
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    runner = _runner(path, trust_remote_code=True)
    info = runner.model_info()
    assert (info["architecture"], info["model_impl"]) == ("MyPhiForCausalLM", "transformers")
    hf = transformers.PhiForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(lengths=(7, 30))
    assert [o.token_ids for o in runner.generate(prompts, GREEDY)] == [_hf_greedy(hf, p) for p in prompts]


def test_remote_config_needs_trust_remote_code(tmp_path):
    path = make_arch(tmp_path, "gpt_neox")
    _edit_config(path, model_type="my_remote_type", architectures=["MyRemoteForCausalLM"],
                 auto_map={"AutoConfig": "configuration_my.MyConfig",
                           "AutoModelForCausalLM": "modeling_my.MyRemoteForCausalLM"})
    with pytest.raises(ModelLoadError, match=r"architecture 'MyRemoteForCausalLM' is remote code .*runs only with "
                                             r"trust_remote_code=True"):
        _runner(path)


@pytest.mark.parametrize("fields, message", [
    (dict(attn_logit_softcapping=50.0, final_logit_softcapping=None),
     "it uses attn_logit_softcapping=50.0 (softcapping), which the runner's paged attention and LM head do not"),
    (dict(attn_logit_softcapping=None, final_logit_softcapping=30.0),
     "it uses final_logit_softcapping=30.0 (softcapping)"),
    (dict(attn_logit_softcapping=None, final_logit_softcapping=None),
     "its layer_types mix full_attention, sliding_attention: per-layer sliding windows"),
])
def test_features_the_step_cannot_express_are_refused(tmp_path, fields, message):
    config = transformers.Gemma2Config(**_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=512, sliding_window=8, **fields)
    path = make_hf_model(tmp_path, config)
    with pytest.raises(ModelLoadError, match=re.escape(f"architecture 'Gemma2ForCausalLM' cannot run through the "
                                                       f"transformers fallback: {message}")):
        _runner(path)


def test_per_layer_sliding_windows_are_refused(tmp_path):
    from tests.helpers import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ModelLoadError, match="'Qwen2ForCausalLM' cannot run through the transformers fallback: its "
                                             "layer_types mix full_attention, sliding_attention"):
        _runner(path, model_impl="transformers")


def test_probe_refuses_what_the_config_does_not_say():
    """Built directly (past the config checks), the probe sees each layer's attention call."""
    base = dict(**_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8)
    gemma2 = TransformersForCausalLM.for_class(transformers.Gemma2ForCausalLM)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM cannot run through the transformers fallback: layer 0 "
                                         r"applies attention softcapping \(softcap=50.0\)"):
        gemma2(transformers.Gemma2Config(**base, attn_logit_softcapping=50.0, final_logit_softcapping=None))
    with pytest.raises(ValueError, match=r"its layers use different sliding windows \(\[8, None\]: per-layer sliding "
                                         r"windows\)"):
        gemma2(transformers.Gemma2Config(**base, attn_logit_softcapping=None, final_logit_softcapping=None))


def test_post_processed_logits_are_refused(tmp_path):
    config = transformers.GraniteConfig(**_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        logits_scaling=4.0)
    path = make_hf_model(tmp_path, config)
    with pytest.raises(ModelLoadError, match="GraniteForCausalLM cannot run through the transformers fallback: its "
                                             "forward post-processes the LM head's logits"):
        _runner(path)


def test_tensor_parallel_fallback_is_refused(neox):
    with pytest.raises(ConfigError, match=r"architecture 'GPTNeoXForCausalLM' runs through the transformers "
                                          r"fallback, which runs on one device for now: tensor_parallel_size=2 .*use "
                                          r"tensor_parallel_size=1"):
        _runner(neox[0], tensor_parallel_size=2)
    suggestion = runner_core.suggest_parallel_config(str(neox[0]), ["cpu"] * 2, device_memory=1 << 34,
                                                     dtype="float32", max_model_len=512)
    assert suggestion.as_config() == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    assert all("the transformers fallback runs on one device" in c["why"] for c in suggestion.candidates
               if c["tp"] * c["pp"] > 1)
