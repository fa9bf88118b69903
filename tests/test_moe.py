"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on the same weights:
logits, greedy tokens, router logits, per-expert token counts (a bincount of transformers' top-k
choices), both checkpoint layouts, the fused experts' two implementations, and every refusal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runner_core import ConfigError, InvalidRequestError, ModelLoadError, ModelRunner, SamplingParams
from runner_core.layers.fused_moe import fused_experts, route
from tests.moe_models import FAMILIES, make_tiny_moe_model, to_fused_layout

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# a small step budget: prompts are chunked and steps mix prefill chunks with decodes
SETTINGS = {"dtype": "float32", "kv_cache_memory": 1 << 22, "max_num_seqs": 8, "max_num_batched_tokens": 48}
# ours against transformers in float32: the same sums in another order (our panel GEMM, its MKL).
# Measured over 3 families x 3 weight seeds x 2 prompt sets: at most 1.1e-5 on logits up to 6, 2.4e-5 on
# router logits up to 17; bound 2x the larger, absolute
HF_ATOL = 5e-5


def _prompts(lengths=(3, 11, 40, 1, 75), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    path = make_tiny_moe_model(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner({"model": str(path), **SETTINGS}).load_model()
    yield request.param, path, hf, runner
    runner.shutdown()


def _hf_top_k_counts(hf, seqs: list[list[int]]) -> torch.Tensor:
    """[MoE layers, experts]: how often transformers' router picks each expert over these tokens."""
    cfg = hf.config
    k, total = cfg.num_experts_per_tok, None
    with torch.no_grad():
        for seq in seqs:
            layers = hf(torch.tensor([seq]), output_router_logits=True).router_logits
            counts = torch.stack([torch.bincount(torch.topk(torch.softmax(r.float(), -1), k).indices.flatten(),
                                                 minlength=r.shape[-1]) for r in layers])
            total = counts if total is None else total + counts
    return total


def test_registered_as_moe(pair):
    family, _, hf, runner = pair
    info = runner.model_info()
    assert (info["architecture"], info["kind"], info["model_impl"]) == (hf.config.architectures[0], "moe", "native")


def test_forward_logits_and_router_logits_close(pair):
    _, _, hf, runner = pair
    ids = torch.tensor(_prompts(lengths=(24, 24)))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding on row 1
    out = runner.forward(ids, attention_mask=mask, output_router_logits=True)
    with torch.no_grad():
        full = hf(ids[:1], output_router_logits=True)
        part = hf(ids[1:, 6:], output_router_logits=True)
    torch.testing.assert_close(out["logits"][0], full.logits[0], atol=HF_ATOL, rtol=0)
    torch.testing.assert_close(out["logits"][1, 6:], part.logits[0], atol=HF_ATOL, rtol=0)
    router = out["router_logits"]
    assert len(router) == len(full.router_logits) == len(runner.moe_stats()["layers"])
    for ours, ref_full, ref_part in zip(router, full.router_logits, part.router_logits):
        assert ours.shape == (2, 24, hf.config.num_experts if hasattr(hf.config, "num_experts")
                              else hf.config.num_local_experts)
        torch.testing.assert_close(ours[0], ref_full, atol=HF_ATOL, rtol=0)
        torch.testing.assert_close(ours[1, 6:], ref_part, atol=HF_ATOL, rtol=0)
        assert ours[1, :6].abs().sum() == 0  # padding positions are zero, as in the logits
    assert out["logits"][1, :6].abs().sum() == 0


def test_greedy_tokens_equal_transformers(pair):
    _, _, hf, runner = pair
    prompts = _prompts()
    outs = runner.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_expert_counts_equal_a_bincount_of_transformers_top_k(pair):
    """Every token the engine ran (prompt and generated, all but the last sampled one) once per layer,
    chunked prefill and decodes alike; per step and in moe_stats()."""
    _, _, hf, runner = pair
    prompts = _prompts(lengths=(5, 60, 17), seed=3)
    before, steps_before = runner.moe_stats(), runner.engine.observer.num_steps
    outs = runner.generate(prompts, GREEDY)
    after = runner.moe_stats()
    delta = torch.tensor(after["cumulative"]) - torch.tensor(before["cumulative"])
    expected = _hf_top_k_counts(hf, [p + o.token_ids[:-1] for p, o in zip(prompts, outs)])
    assert delta.tolist() == expected.tolist()
    steps = list(runner.step_metrics)[-(after["steps"] - steps_before):]
    assert sum(m.expert_counts for m in steps).tolist() == delta.tolist()
    for m in steps:  # each layer's row adds up to top_k x the step's tokens
        assert m.expert_counts.sum(1).tolist() == [after["top_k"] * (m.num_prefill_tokens + m.num_decode_tokens)] * \
            len(after["layers"])
    recent = runner.moe_stats(recent_steps=len(steps))
    assert recent["recent"] == delta.tolist() and recent["recent_steps"] == len(steps)


def test_fused_checkpoint_layout_loads(pair, tmp_path):
    family, path, hf, runner = pair
    fused = to_fused_layout(shutil.copytree(path, tmp_path / "fused"))
    names = load_file(fused / "model.safetensors").keys()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    ids = torch.tensor(_prompts(lengths=(20,)))
    other = ModelRunner({"model": str(fused), **SETTINGS}).load_model()
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(other.forward(ids)["logits"], ref, atol=HF_ATOL, rtol=0)
    assert other.generate(_prompts()[:2], GREEDY)[1].token_ids == runner.generate(_prompts()[:2], GREEDY)[1].token_ids


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_fused_experts_equal_a_per_token_reference(impl):
    g = torch.Generator().manual_seed(0)
    n, h, i, e, k = 37, 16, 24, 5, 2
    x, w13 = torch.randn(n, h, generator=g), torch.randn(e, 2 * i, h, generator=g)
    w2 = torch.randn(e, h, i, generator=g)
    weights, ids = route(torch.randn(n, e, generator=g), k, renormalize=True)
    ref = torch.zeros(n, h)
    for t in range(n):  # the definition, token by token
        for j in range(k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, impl=impl), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(n))


# ---- refusals, each by its message --------------------------------------------------------------
def _edit_config(path, tmp_path, **fields):
    out = shutil.copytree(path, tmp_path / "edited")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(fields)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("refusals"), "mixtral")


def test_dense_model_has_no_router_logits_or_expert_stats(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    with pytest.raises(InvalidRequestError, match="output_router_logits=True needs a mixture-of-experts model; "
                                                  "LlamaForCausalLM .* has no router"):
        runner.forward(torch.tensor([[5, 6, 7]]), output_router_logits=True)
    with pytest.raises(InvalidRequestError, match=r"moe_stats\(\) needs a mixture-of-experts model"):
        runner.moe_stats()
    assert runner.step_metrics is not None and "router_logits" not in runner.forward(torch.tensor([[5, 6]]))
    runner.shutdown()


def test_bad_recent_steps_is_refused(pair):
    with pytest.raises(InvalidRequestError, match="recent_steps must be an int >= 1, got 0"):
        pair[3].moe_stats(recent_steps=0)


def test_top_k_beyond_the_experts_is_refused(mixtral_path, tmp_path):
    path = _edit_config(mixtral_path, tmp_path, num_experts_per_tok=7)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=7 must be between 1 and the number of experts \(6\)"):
        ModelRunner({"model": str(path), **SETTINGS}).load_model()


def test_bad_decoder_sparse_step_is_refused(tmp_path):
    path = _edit_config(make_tiny_moe_model(tmp_path, "qwen3_moe"), tmp_path, decoder_sparse_step=0)
    with pytest.raises(ConfigError, match="decoder_sparse_step=0 must be an int >= 1"):
        ModelRunner({"model": str(path), **SETTINGS}).load_model()


def test_tensor_parallel_size_must_divide_the_expert_width(tmp_path):
    path = _edit_config(make_tiny_moe_model(tmp_path, "qwen2_moe"), tmp_path, moe_intermediate_size=33)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide moe_intermediate_size=33 "
                                          r"\(each expert's width"):
        ModelRunner({"model": str(path), **SETTINGS, "tensor_parallel_size": 2}).load_model()


def test_missing_expert_is_refused(mixtral_path, tmp_path):
    path = shutil.copytree(mixtral_path, tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.4.w2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="parameters of the model were not in the checkpoint .*"
                                             "model.layers.1.mlp.experts.down_proj"):
        ModelRunner({"model": str(path), **SETTINGS}).load_model()


def test_expert_beyond_the_config_is_refused(mixtral_path, tmp_path):
    path = shutil.copytree(mixtral_path, tmp_path / "extra")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.6.w1.weight"] = torch.zeros(96, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="experts.6.w1.weight.*expert 6 does not exist: the config has 6 experts"):
        ModelRunner({"model": str(path), **SETTINGS}).load_model()


def test_fused_tensor_of_the_wrong_shape_is_refused(mixtral_path, tmp_path):
    path = to_fused_layout(shutil.copytree(mixtral_path, tmp_path / "bad"))
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][:, :96].contiguous()  # the gate rows only
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"gate_up_proj of shape \(6, 96, 64\) should be \[6, 192, hidden\]"):
        ModelRunner({"model": str(path), **SETTINGS}).load_model()
