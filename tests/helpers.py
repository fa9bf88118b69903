"""Tiny random-weight Hugging Face checkpoints for tests, built locally (no download), a switch that
turns the native kernels off for the runners a test makes, and one step's attention metadata built as
the forward pass builds it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers

from runner_core import kernels
from runner_core.engine import InputBuffers
from runner_core.engine.forward_pass import METADATA_BUILDERS
from runner_core.layers.attention import CommonAttentionMetadata

_FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
# Logits std ~ sqrt(64) * 0.15 ~ 1.2: greedy top-1/top-2 gaps far above fp32 noise,
# and greedy continuations that keep changing instead of repeating one token.
INITIALIZER_RANGE = 0.15


def make_tiny_hf_model(
    tmp_path: Path,
    family: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    rope_scaling: dict | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    **extra,
) -> Path:
    """Save a 2-layer model of `family` (safetensors, no tokenizer) in a new directory under tmp_path.

    Biases (Qwen2's qkv) and norm weights are randomised too, so a loader that
    drops them cannot pass a parity test by luck.
    """
    config_cls, model_cls = _FAMILIES[family]
    config = config_cls(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=INITIALIZER_RANGE, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **({"head_dim": head_dim} if head_dim is not None else {}),
        **({"rope_scaling": rope_scaling} if rope_scaling is not None else {}),
        **extra,
    )
    return save_random_model(model_cls, config, tmp_path, f"tiny-{family}", seed)


def save_random_model(model_cls, config, tmp_path: Path, prefix: str, seed: int = 0,
                      init: float = INITIALIZER_RANGE, router_names: tuple[str, ...] = ()) -> Path:
    """Build `model_cls(config)` from `seed` on CPU (fp32), randomise biases (std `init`), norm weights
    (around 1) and the parameters ending in `router_names` (std 0.5: decisive routing), so a loader
    that drops or swaps one cannot pass; save it (safetensors) in a new directory under tmp_path."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, init)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
            elif router_names and name.endswith(router_names):
                param.normal_(0.0, 0.5)
    out = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=tmp_path))
    model.save_pretrained(out)
    return out


IMAGE_TOKEN_ID = 511  # the tiny LLaVA's "<image>": the last id of its 512-token vocabulary


def make_tiny_llava(tmp_path: Path, seed: int = 0) -> Path:
    """A 2-layer LLaVA (CLIP vision tower 32x32 pixels in 8x8 patches: 16 image tokens, a Llama text
    model) with its tokenizer and processor, saved under tmp_path (safetensors, no download)."""
    from runner_core.models.presets import llava_config, save_llava_processor

    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2)
    text = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    initializer_range=INITIALIZER_RANGE, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0)
    config = llava_config(text, vision)
    out = save_random_model(transformers.LlavaForConditionalGeneration, config, tmp_path, "tiny-llava", seed)
    save_llava_processor(out, 512, 512, vision)
    return out


def random_image(seed: int, size: tuple[int, int] = (40, 48)):
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@contextmanager
def native_kernels_off() -> Iterator[None]:
    """Runners made inside take the torch paths, as on a CPU where the kernels do not build:
    RUNNER_CORE_NO_KERNELS=1 (spawned workers inherit it), the switch read again (it is read once per process)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNNER_CORE_NO_KERNELS", "1")
        patch.setattr(kernels, "_state", {})
        assert not kernels.cpu_kernels_available()
        yield


def step_metadata(backend: str, starts: list[int], q_lens: list[int], tables: list[list[int]], block_size: int,
                  sliding_window: int | None = None, num_pool_blocks: int = 0):
    """The `backend`'s metadata (CPU tensors) of one step over the pool: sequences (decodes, one new token,
    first) with `q_lens` new tokens from `starts` and block tables `tables`, sent to a fresh BlockTable,
    written into fresh InputBuffers and built by the backend's builder, as ForwardPass.prepare does."""
    buffers = InputBuffers(sum(q_lens), len(starts), max(map(len, tables)), torch.device("cpu"))
    rows = buffers.block_table.update([], [(i, 0, table) for i, table in enumerate(tables)], range(len(tables)))
    common = buffers.fill([0] * sum(q_lens), starts, q_lens, sum(1 for n in q_lens if n == 1), rows, block_size,
                          sliding_window, num_pool_blocks=num_pool_blocks)
    builder = METADATA_BUILDERS[backend]
    meta = builder.build(common)
    builder.finish(meta, common)
    return meta


def stateless_metadata(q_lens: list[int], block_size: int):
    """The metadata of a stateless forward (fresh sequences over their own tokens, no pool)."""
    common = CommonAttentionMetadata.without_pool([0] * len(q_lens), q_lens, sum(1 for n in q_lens if n == 1),
                                                  block_size, None)
    return METADATA_BUILDERS["gather"].build(common)
