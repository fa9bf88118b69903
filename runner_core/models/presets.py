"""Built-in presets: small random-weight models made from a seed on first use (Llama, the MoE
families Mixtral and Qwen3-MoE, and LLaVA with its processor), random weights in the exact shapes of
published checkpoints (`REAL_SIZE_PRESETS`: Qwen2.5-0.5B, Llama-3.2-1B, stored in bfloat16), and
`tiny-speaker`, a trained model shipped in the package (`SHIPPED_PRESETS`, built by
`python -m runner_tools.train_preset`).

No download: each preset is built with transformers' own classes (the spec names its config and
model class and any config fields beyond the common ones) and a byte-level
BPE tokenizer whose merges are generated, not trained, then cached under
`$RUNNER_WORKBENCH_CACHE/presets/<name>-<hash of the spec>` by `cache_dir.build_cached` (a temporary
sibling renamed into place: concurrent builders never leave a half-written preset behind).
`runner_core.models.catalogue` resolves a preset's name, beside the config-only models'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import torch
from tqdm import tqdm

from runner_core.cache_dir import build_cached, cache_root
from runner_core.errors import ModelLoadError

# Bump when the build recipe changes, so cached presets are rebuilt.
_RECIPE_VERSION = 1
# Byte-level symbol of a space, and letters by English frequency: the alphabet of generated merges.
_SPACE = "Ġ"
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PresetSpec:
    description: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    # Logits std ~ sqrt(hidden) * initializer_range; ~1.1 keeps greedy decoding decisive
    # (median top-1/top-2 gap ~0.25) without collapsing into one repeated token.
    initializer_range: float = 0.02
    seed: int = 0
    config_class: str = "LlamaConfig"  # transformers' config and model classes
    model_class: str = "LlamaForCausalLM"
    extra: dict = dataclasses.field(default_factory=dict)  # further config fields (experts, head_dim, ...)
    # CLIP vision tower fields: the model is a LLaVA (model_class) around the text model, the last
    # vocabulary id is its "<image>" token, and a LlavaProcessor is saved beside the tokenizer
    vision: dict = dataclasses.field(default_factory=dict)


PRESETS: dict[str, PresetSpec] = {
    "tiny-llama": PresetSpec(
        description="~0.9M-parameter Llama (GQA 4/2) for tests and demos",
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.1,
    ),
    "small-llama": PresetSpec(
        description="~31.6M-parameter Llama (GQA 8/4), the throughput baseline",
        vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        initializer_range=0.05,
    ),
    "tiny-mixtral": PresetSpec(
        description="~3.5M-parameter Mixtral (8 experts, top-2, GQA 4/2) for tests and demos",
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.1, config_class="MixtralConfig", model_class="MixtralForCausalLM",
        extra={"num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "tiny-qwen3-moe": PresetSpec(
        description="~1.6M-parameter Qwen3-MoE (16 experts, top-4, a dense first layer, q/k norm) for tests",
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.1, config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM",
        extra={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64, "norm_topk_prob": True,
               "mlp_only_layers": [0], "head_dim": 32},
    ),
    "small-qwen3-moe": PresetSpec(
        description="~90M-parameter Qwen3-MoE (16 experts, top-4, ~25M active per token), the MoE benchmark model",
        vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        initializer_range=0.05, config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM",
        extra={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 384, "norm_topk_prob": True,
               "head_dim": 64},
    ),
    "tiny-llava": PresetSpec(
        description="~1.0M-parameter LLaVA (CLIP tower, 32x32 images in 8x8 patches: 16 image tokens; a "
                    "Llama text model) with its processor, for tests and demos",
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.1, model_class="LlavaForConditionalGeneration",
        vision={"image_size": 32, "patch_size": 8, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 2},
    ),
}


# Random weights in the exact shapes of published checkpoints, for measuring at real sizes (benchmarks).
# Every field given here is the published config.json's (Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B),
# initializer_range included, and the weights are stored in bfloat16 as theirs are; the token ids
# 0-2 (pad, bos, eos) and the tokenizer are this module's generated ones at the published vocabulary
# size. Parameters: 494,032,768 and 1,235,814,400, as published (tests/test_real_size_presets.py).
REAL_SIZE_PRESETS: dict[str, PresetSpec] = {
    "qwen2.5-0.5b": PresetSpec(
        description="random weights in Qwen2.5-0.5B's exact shape (494M parameters, GQA 14/2, qkv bias, "
                    "tied embeddings), stored in bfloat16",
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
        extra={"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "use_sliding_window": False,
               "hidden_act": "silu", "dtype": "bfloat16"},
    ),
    "llama-3.2-1b": PresetSpec(
        description="random weights in Llama-3.2-1B's exact shape (1.24B parameters, GQA 32/8, llama3 rope "
                    "scaling, tied embeddings), stored in bfloat16",
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        extra={"head_dim": 64, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "attention_bias": False,
               "mlp_bias": False, "hidden_act": "silu", "dtype": "bfloat16",
               "rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ),
}
PRESETS.update(REAL_SIZE_PRESETS)


def scaled_down(spec: PresetSpec) -> PresetSpec:
    """`spec` at test size (vocabulary 512, hidden 128, 2 layers, 4 heads of 32 over 2 KV heads), every
    other option kept: config class, tied embeddings, biases, rope type and scaling, norm epsilon, stored
    dtype, position limit. The initializer range keeps its logits' spread (~1.1 std, decisive greedy)."""
    return dataclasses.replace(
        spec, description=f"scaled-down copy: {spec.description}", vocab_size=512, hidden_size=128,
        intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.1, extra={k: v for k, v in spec.extra.items() if k != "head_dim"})

# Trained presets shipped under preset_data/<name>/ (package data): loaded as they are, never built here.
SHIPPED_PRESETS: dict[str, str] = {
    "tiny-speaker": "~1M-parameter Llama trained on the Python standard library's docstrings: its text is words",
    "tiny-speaker-draft": "~0.23M-parameter Llama (2 layers, hidden 64) trained like tiny-speaker with its tokenizer: "
                          "its speculative-decoding draft",
}
SHIPPED_DIR = Path(__file__).parent / "preset_data"


def preset_names() -> list[str]:
    return [*PRESETS, *SHIPPED_PRESETS]


def is_preset(name: str) -> bool:
    return name in PRESETS or name in SHIPPED_PRESETS


def preset_dir(name: str) -> Path:
    """Where preset `name` lives once built (the name carries a hash of its spec)."""
    spec = _spec(name)
    blob = json.dumps({"recipe": _RECIPE_VERSION, **dataclasses.asdict(spec)}, sort_keys=True)
    return cache_root() / "presets" / f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def ensure_preset(name: str) -> Path:
    """The directory of preset `name`: the shipped one, or the cached build (built first if missing)."""
    if name in SHIPPED_PRESETS:
        shipped = SHIPPED_DIR / name
        if not (shipped / "model.safetensors").is_file():
            raise ModelLoadError(f"the shipped preset {name!r} is missing from {shipped}: reinstall the package "
                                 "or rebuild it with `make preset`")
        return shipped
    return build_cached(preset_dir(name), lambda out: build_preset(_spec(name), out, name))


def _spec(name: str) -> PresetSpec:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return PRESETS[name]


def hf_config(spec: PresetSpec):
    """transformers' config of `spec` (a LlavaConfig around the text model when it has a vision tower);
    `spec.extra` adds config fields or overrides the common ones (its `rope_parameters` are merged into
    the default rope's)."""
    import transformers  # heavy: only needed when a preset is built

    extra = dict(spec.extra)
    fields = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta, **extra.pop("rope_parameters", {})},
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config = getattr(transformers, spec.config_class)(**{**fields, **extra})
    return llava_config(config, spec.vision) if spec.vision else config


def build_preset(spec: PresetSpec, out: Path, name: str = "preset") -> None:
    """Writes the model of `spec` (random weights from its seed, stored in its config's `dtype`, float32
    unless `extra` names one), its generation config and its tokenizer (or LLaVA processor) to `out`.
    Peak memory: the model once in float32, converted to the stored dtype tensor by tensor."""
    import transformers

    with tqdm(total=4, desc=f"Building preset {name} (first use)", unit="step") as bar:
        config = hf_config(spec)
        bar.set_postfix_str("random weights")
        # A private RNG on CPU: the caller's RNG state and default device neither matter nor change.
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(spec.seed)
            model = getattr(transformers, spec.model_class)(config).to(torch.float32)
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False
        )
        bar.update()
        dtype = getattr(torch, spec.extra.get("dtype", "float32"))
        bar.set_postfix_str(f"to {spec.extra.get('dtype', 'float32')}")
        model.to(dtype)
        bar.update()
        bar.set_postfix_str("safetensors")
        model.save_pretrained(out)
        del model
        bar.update()
        bar.set_postfix_str("tokenizer")
        if spec.vision:
            save_llava_processor(out, spec.vocab_size, spec.max_position_embeddings, spec.vision)
        else:
            build_tokenizer(spec.vocab_size, spec.max_position_embeddings).save_pretrained(out)
        bar.update()


IMAGE_TOKEN = "<image>"


def llava_config(text_config, vision: dict):
    """A LlavaConfig around `text_config` with a CLIP tower of `vision`'s fields; the image token is the
    last vocabulary id and each image becomes (image_size / patch_size)^2 tokens (CLS dropped)."""
    import transformers

    tower = transformers.CLIPVisionConfig(**vision)
    return transformers.LlavaConfig(
        vision_config=tower, text_config=text_config, image_token_id=text_config.vocab_size - 1,
        image_seq_length=(tower.image_size // tower.patch_size) ** 2,
        vision_feature_select_strategy="default", vision_feature_layer=-2)


def save_llava_processor(out: Path, vocab_size: int, model_max_length: int, vision: dict) -> None:
    """The tokenizer (`vocab_size` - 1 ids plus the image token) and a LlavaProcessor (CLIP resize and
    crop to the tower's image size) saved under `out`."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tokenizer = build_tokenizer(vocab_size - 1, model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    side = vision["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=vision["patch_size"],
                   image_token=IMAGE_TOKEN, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(out)


def build_tokenizer(vocab_size: int, model_max_length: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, lossless on any UTF-8.

    Ids: 0-2 special, 3-258 the 256 byte symbols, then generated merges: short
    letter strings (optionally after a space) ordered by letter frequency.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_symbols = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_symbols[b]: len(SPECIAL_TOKENS) + b for b in range(256)})
    merges = _generate_merges(vocab_size - len(vocab), set(vocab))
    for left, right in merges:
        vocab[left + right] = len(vocab)

    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges))
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


def _generate_merges(count: int, known: set[str]) -> list[tuple[str, str]]:
    """`count` merges (prefix, last letter), shortest strings first, then most frequent letters."""
    rank = {c: i for i, c in enumerate(_SPACE + _LETTERS)}
    known = set(known)
    merges: list[tuple[str, str]] = []
    for length in itertools.count(2):
        words = ["".join(w) for first in _SPACE + _LETTERS
                 for w in itertools.product(first, *[_LETTERS] * (length - 1))]
        words.sort(key=lambda w: (sum(rank[c] for c in w), [rank[c] for c in w]))
        for word in words:
            if len(merges) == count:
                return merges
            if word[:-1] in known and word not in known:
                merges.append((word[:-1], word[-1]))
                known.add(word)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def stored_dtype(name: str) -> str:
    """The dtype preset `name` stores its weights in (its config's dtype; float32 unless the spec says)."""
    if name in SHIPPED_PRESETS:
        raw = json.loads((SHIPPED_DIR / name / "config.json").read_bytes())
        return raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return _spec(name).extra.get("dtype", "float32")
