"""User architectures (the seed's section 2.5): a model built from runner_core.layers, registered
with runner_core.register_model, loads from a safetensors checkpoint and generates the tokens a
plain-torch reference of the same math gives; classes that break the model contract are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig

import runner_core
from runner_core import ModelLoadError, ModelRunner, SamplingParams, register_model
from runner_core.layers.attention import Attention
from runner_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runner_core.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runner_core.layers.norm import RMSNorm
from runner_core.layers.rotary import RotaryEmbedding
from runner_core.models import MODEL_REGISTRY

ARCH = "TinyGeluForCausalLM"
THETA = 10000.0


class TinyGeluConfig(PretrainedConfig):
    """A config class of our own (registered with AutoConfig, so config.json can name its model_type)."""

    model_type = "runner_test_tiny_gelu"

    def __init__(self, vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.max_position_embeddings = num_key_value_heads, max_position_embeddings
        super().__init__(**kwargs)


AutoConfig.register(TinyGeluConfig.model_type, TinyGeluConfig, exist_ok=True)


class Block(nn.Module):
    """Pre-norm block: GQA attention with rotary, then a GELU MLP (biases on the MLP)."""

    def __init__(self, c):
        super().__init__()
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.norm1, self.norm2 = RMSNorm(c.hidden_size), RMSNorm(c.hidden_size)
        self.qkv = QKVParallelLinear(c.hidden_size, self.head_dim, c.num_attention_heads, c.num_key_value_heads)
        self.o = RowParallelLinear(c.hidden_size, c.hidden_size)
        self.rotary = RotaryEmbedding(self.head_dim, c.max_position_embeddings, THETA)
        self.attn = Attention(c.num_attention_heads, self.head_dim, self.head_dim ** -0.5, c.num_key_value_heads)
        self.up = ColumnParallelLinear(c.hidden_size, c.intermediate_size, bias=True)
        self.down = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=True)
        self.sizes = [c.num_attention_heads * self.head_dim] + [c.num_key_value_heads * self.head_dim] * 2

    def forward(self, positions, x):
        q, k, v = self.qkv(self.norm1(x)).split(self.sizes, dim=-1)
        n = x.shape[0]
        q, k = self.rotary(positions, q.view(n, -1, self.head_dim), k.view(n, -1, self.head_dim))
        x = x + self.o(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGeluForCausalLM(nn.Module):
    """A user architecture following runner_core.register_model's contract."""

    def __init__(self, config):
        super().__init__()
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.num_layers, self.num_kv_heads = config.num_hidden_layers, config.num_key_value_heads
        self.head_dim, self.sliding_window = self.blocks[0].head_dim, None

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(positions, x)
        return self.norm(x)

    def compute_logits(self, hidden):
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for part in ("q", "k", "v"):  # checkpoint q/k/v -> the fused qkv projection
                if name.endswith(f".{part}.weight"):
                    target = name.replace(f".{part}.", ".qkv.")
                    params[target].weight_loader(params[target], tensor, part)
                    break
            else:
                target = name
                loader = getattr(params[target], "weight_loader", None)  # norms have none
                if loader is not None:
                    loader(params[target], tensor)
                else:
                    params[target].data.copy_(tensor)
            loaded.add(target)
        return loaded


def _checkpoint(tmp_path, config: TinyGeluConfig) -> dict[str, torch.Tensor]:
    """Random weights under the architecture's checkpoint names, saved with safetensors."""
    g = torch.Generator().manual_seed(0)
    h, i, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * d

    def rand(*shape, mean=0.0):
        return (torch.randn(*shape, generator=g) * 0.15 + mean).contiguous()

    w = {"embed.weight": rand(config.vocab_size, h), "norm.weight": rand(h, mean=1.0),
         "lm_head.weight": rand(config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"blocks.{n}."
        w.update({p + "norm1.weight": rand(h, mean=1.0), p + "norm2.weight": rand(h, mean=1.0),
                  p + "q.weight": rand(h, h), p + "k.weight": rand(kv, h), p + "v.weight": rand(kv, h),
                  p + "o.weight": rand(h, h), p + "up.weight": rand(i, h), p + "up.bias": rand(i),
                  p + "down.weight": rand(h, i), p + "down.bias": rand(h)})
    config.architectures = [ARCH]
    config.save_pretrained(tmp_path)
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return w


def _reference_logits(w: dict, c: TinyGeluConfig, ids: list[int]) -> torch.Tensor:
    """The same math in plain torch over one sequence (full causal attention, no cache)."""
    n, hd = len(ids), c.hidden_size // c.num_attention_heads
    pos = torch.arange(n, dtype=torch.float64)
    inv = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = (torch.outer(pos, inv).cos().float()[:, None], torch.outer(pos, inv).sin().float()[:, None])

    def norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    x = w["embed.weight"][ids]
    for layer in range(c.num_hidden_layers):
        p = f"blocks.{layer}."
        y = norm(x, w[p + "norm1.weight"])
        q = rope((y @ w[p + "q.weight"].T).view(n, -1, hd))
        k = rope((y @ w[p + "k.weight"].T).view(n, -1, hd))
        v = (y @ w[p + "v.weight"].T).view(n, -1, hd)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        x = x + att.transpose(0, 1).reshape(n, -1) @ w[p + "o.weight"].T
        y = norm(x, w[p + "norm2.weight"])
        x = x + F.gelu(y @ w[p + "up.weight"].T + w[p + "up.bias"]) @ w[p + "down.weight"].T + w[p + "down.bias"]
    return norm(x, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture
def registry(monkeypatch):
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(MODEL_REGISTRY, "_targets", dict(MODEL_REGISTRY._targets))
    return MODEL_REGISTRY


def test_registered_user_architecture_generates(tmp_path, registry):
    config = TinyGeluConfig()
    weights = _checkpoint(tmp_path, config)
    register_model(ARCH, TinyGeluForCausalLM)
    assert runner_core.supported_architectures()[ARCH] == "native"
    runner = ModelRunner({"model": str(tmp_path), "dtype": "float32", "kv_cache_memory": 1 << 21}).load_model()
    info = runner.model_info()
    assert (info["architecture"], info["model_impl"], info["model_class"], info["reason"]) == (
        ARCH, "native", ARCH, "auto: a native adapter is registered")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 19, 1, 50)]
    outs = runner.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids, ref = list(prompt), []
        for _ in range(12):
            ref.append(int(_reference_logits(weights, config, ids)[-1].argmax()))
            ids.append(ref[-1])
        assert out.token_ids == ref
    torch.testing.assert_close(runner.forward(torch.tensor([prompts[3]]))["logits"][0],
                               _reference_logits(weights, config, prompts[3]), atol=1e-4, rtol=1e-4)


class NoLogits(nn.Module):
    def forward(self, input_ids, positions): ...

    def load_weights(self, weights): ...


class WrongForward(TinyGeluForCausalLM):
    def forward(self, batch): ...


class WrongConstructor(TinyGeluForCausalLM):
    def __init__(self, config, tokenizer):
        super().__init__(config)


class NoAttributes(TinyGeluForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        del self.num_kv_heads, self.sliding_window


def test_contract_violations_are_refused(tmp_path, registry):
    with pytest.raises(TypeError, match="NoLogits cannot run on the runner: it has no compute_logits "
                                        r"\(the model contract: forward, compute_logits, load_weights"):
        register_model(ARCH, NoLogits)
    with pytest.raises(TypeError, match=r"register_model\('TinyGeluForCausalLM', ...\) takes a model class, got "
                                        "TinyGeluForCausalLM"):
        register_model(ARCH, TinyGeluForCausalLM(TinyGeluConfig()))
    with pytest.raises(TypeError, match=r"WrongForward's forward takes \(self, batch\), but the runner calls "
                                        r"forward\(input_ids, positions\)"):
        register_model(ARCH, WrongForward)
    with pytest.raises(TypeError, match=r"WrongConstructor's constructor takes \(config, tokenizer\), but the "
                                        r"runner calls model_cls\(hf_config\)"):
        register_model(ARCH, WrongConstructor)
    assert ARCH not in registry.native_architectures()
    _checkpoint(tmp_path, TinyGeluConfig())
    register_model(ARCH, NoAttributes)
    with pytest.raises(ModelLoadError, match="NoAttributes does not set num_kv_heads, sliding_window, which the "
                                             "runner reads"):
        ModelRunner({"model": str(tmp_path), "dtype": "float32", "kv_cache_memory": 1 << 21}).load_model()
