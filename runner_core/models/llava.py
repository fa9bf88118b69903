"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower and projector (transformers' own
modules) in front of the runner's Llama text model.

Image features are the vision tower's `vision_feature_layer` hidden states (CLS dropped under the
"default" strategy) through the projector, [images, tokens per image, hidden]; the worker computes
them once per image (engine/encoder_cache.py) and the step's forward context carries the rows to
place at the image-token positions: the text model's embedding merges them (an opaque op, so
compiled programs keep the merge outside their graph).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from runner_core.layers.attention import get_forward_context
from runner_core.layers.embedding import VocabParallelEmbedding
from runner_core.models.llama import LlamaForCausalLM


@torch.library.custom_op("runner_core::merge_multimodal", mutates_args=())
def merge_multimodal(embeds: torch.Tensor) -> torch.Tensor:
    """`embeds` [N, H] with the step's image-feature rows placed at their token positions."""
    mm = get_forward_context().multimodal
    if mm is None:
        return embeds.clone()
    positions, features = mm
    out = embeds.clone()
    out[positions] = features.to(out.dtype)
    return out


@merge_multimodal.register_fake
def _(embeds):
    return torch.empty_like(embeds)


class MultimodalEmbedding(VocabParallelEmbedding):
    """The text model's token embedding, then the step's image features at the image tokens."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = super().forward(input_ids)
        if torch.compiler.is_compiling() or get_forward_context().multimodal is not None:
            return merge_multimodal(embeds)
        return embeds


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.config = config
        text = config.get_text_config()
        self.image_token_id = config.image_token_id
        self.vision_feature_layer = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"
        if not isinstance(self.vision_feature_layer, int):
            raise ValueError(f"vision_feature_layer={self.vision_feature_layer!r}: only one feature layer (an int) "
                             "is supported")
        vision = config.vision_config
        self.tokens_per_image = (vision.image_size // vision.patch_size) ** 2 + (0 if self.drop_cls else 1)
        self.vision_tower = AutoModel.from_config(vision)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = LlamaForCausalLM(text)
        lm = self.language_model
        if lm.model.embed_tokens is not None:
            lm.model.embed_tokens = MultimodalEmbedding(text.vocab_size, text.hidden_size)
            if lm.lm_head is not None and text.tie_word_embeddings:
                lm.lm_head.weight = lm.model.embed_tokens.weight
        self.num_layers, self.num_kv_heads, self.head_dim = lm.num_layers, lm.num_kv_heads, lm.head_dim
        self.sliding_window = lm.sliding_window
        self.hidden_size = text.hidden_size

    @property
    def model(self) -> nn.Module:
        """The text model's decoder (what compile scopes and the compile key look into)."""
        return self.language_model.model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    @torch.inference_mode()
    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, tokens_per_image, hidden] for pixel values [images, 3, H, W]."""
        param = next(self.vision_tower.parameters())
        out = self.vision_tower(pixel_values.to(param.device, param.dtype), output_hidden_states=True)
        features = out.hidden_states[self.vision_feature_layer]
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names of both layouts transformers writes: `language_model.model.*` /
        `model.language_model.*` (the text model), `vision_tower.*` and `multi_modal_projector.*`
        with or without a `model.` prefix, `lm_head.*` / `language_model.lm_head.*`."""
        own = {name: p for name, p in self.named_parameters()}
        own.update(dict(self.named_buffers()))
        text, loaded = [], set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                if name not in own:
                    raise ValueError(f"checkpoint tensor '{name}' has no matching parameter in the vision tower "
                                     "or projector")
                target = own[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"'{name}': checkpoint shape {tuple(tensor.shape)} does not match expected "
                                     f"{tuple(target.shape)}")
                target.data.copy_(tensor.to(target.dtype))
                loaded.add(name)
            else:
                name = name.removeprefix("language_model.")
                text.append((name if name.startswith(("model.", "lm_head.")) else f"model.{name}", tensor))
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        return loaded
