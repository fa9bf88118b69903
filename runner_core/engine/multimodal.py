"""Multimodal request inputs in vLLM's form: `{"prompt": "... <image> ...", "multi_modal_data":
{"image": PIL.Image | tensor | [...]}}` or `{"prompt_token_ids": [...], "multi_modal_data": ...}`.

`MultiModalProcessor` turns one into token ids (each image's placeholder expanded to the tokens
its features fill, by the model directory's processor) and one `MultiModalItem` per image: the
hash of its processed pixels (what the encoder cache and prefix-cache block hashes key on), where
its placeholder run starts and how long it is, and the pixels themselves. A bad image, a count
of images that does not match the placeholders, or images for a text-only model raise
InvalidRequestError for that request alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from runner_core.errors import InvalidRequestError

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    hash: str  # sha256 of the processed pixels
    offset: int  # position of its first placeholder token in the prompt
    length: int  # its placeholder tokens (the rows of its features)
    pixel_values: torch.Tensor  # [3, H, W], as the vision tower takes them

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part [a, b) of positions [start, end) that holds this image's tokens, or None."""
        a, b = max(start, self.offset), min(end, self.offset + self.length)
        return (a, b) if a < b else None


def split_prompt(prompt) -> tuple[object, list | None]:
    """(the text or token ids of `prompt`, its images or None) for any accepted prompt form."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = set(prompt) - set(_PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(f"prompt dict has unknown keys {sorted(unknown, key=repr)}; use 'prompt' (text) or "
                                  "'prompt_token_ids', and optionally 'multi_modal_data'")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    content = prompt.get("prompt", prompt.get("prompt_token_ids"))
    data = prompt.get("multi_modal_data")
    if data is None:
        return content, None
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise InvalidRequestError(f"multi_modal_data must be a dict with the key 'image', got "
                                  f"{sorted(data, key=repr) if isinstance(data, Mapping) else type(data).__name__}")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return content, images


def _check_image(image, index: int):
    from PIL import Image

    if isinstance(image, Image.Image):
        try:
            image.load()
        except Exception as exc:  # a truncated or unreadable file behind the object
            raise InvalidRequestError(f"image {index} cannot be read ({type(exc).__name__}: {exc})") from exc
        return image.convert("RGB")
    if isinstance(image, torch.Tensor) and image.dim() == 3 and 3 in (image.shape[0], image.shape[-1]):
        if not torch.isfinite(image.float()).all():
            raise InvalidRequestError(f"image {index} holds NaN or infinite values")
        return image
    kind = f"a tensor of shape {tuple(image.shape)}" if isinstance(image, torch.Tensor) else type(image).__name__
    raise InvalidRequestError(f"image {index} is {kind}; give a PIL.Image or a [3, H, W] (or [H, W, 3]) tensor")


class MultiModalProcessor:
    """The model directory's Hugging Face processor (tokenizer + image processor), bound to the
    model's image token and the number of feature rows an image fills."""

    def __init__(self, hf_processor, image_token_id: int, tokens_per_image: int):
        self.hf, self.image_token_id, self.tokens_per_image = hf_processor, image_token_id, tokens_per_image
        self.image_token = hf_processor.tokenizer.convert_ids_to_tokens(image_token_id)

    def process(self, content, images: list) -> tuple[str | None, list[int], list[MultiModalItem]]:
        """(text, token ids with placeholders expanded, items) of one request."""
        images = [_check_image(im, i) for i, im in enumerate(images)]
        text = content if isinstance(content, str) else None
        placeholders = (content.count(self.image_token) if text is not None
                        else sum(1 for t in content if t == self.image_token_id))
        if text is None and placeholders == len(images) * self.tokens_per_image:
            placeholders = len(images)  # already expanded
        if placeholders != len(images):
            raise InvalidRequestError(
                f"the prompt has {placeholders} image placeholder{'s' * (placeholders != 1)} ({self.image_token}) "
                f"but {len(images)} image{'s' * (len(images) != 1)} {'were' if len(images) != 1 else 'was'} given; "
                "give one image per placeholder")
        try:
            if text is not None:
                out = self.hf(text=[text], images=images or None, return_tensors="pt")
                ids, pixels = out["input_ids"][0].tolist(), out.get("pixel_values")
            else:
                ids = self._expand(list(content))
                pixels = self.hf.image_processor(images, return_tensors="pt")["pixel_values"] if images else None
        except InvalidRequestError:
            raise
        except Exception as exc:  # the image processor's own refusals (sizes, modes, ...)
            raise InvalidRequestError(f"the images could not be processed: {type(exc).__name__}: {exc}") from exc
        return text, ids, [] if pixels is None else self._items(ids, pixels)

    def _expand(self, ids: list[int]) -> list[int]:
        if sum(1 for t in ids if t == self.image_token_id) % self.tokens_per_image == 0 and self._runs_ok(ids):
            return ids
        out = []
        for t in ids:
            out.extend([t] * self.tokens_per_image if t == self.image_token_id else [t])
        return out

    def _runs_ok(self, ids: list[int]) -> bool:
        """Whether every run of image tokens is a whole number of images (already expanded)."""
        run = 0
        for t in [*ids, None]:
            if t == self.image_token_id:
                run += 1
            elif run:
                if run % self.tokens_per_image:
                    return False
                run = 0
        return True

    def _items(self, ids: list[int], pixels: torch.Tensor) -> list[MultiModalItem]:
        where = (torch.tensor(ids) == self.image_token_id).nonzero().flatten().tolist()
        n = self.tokens_per_image
        items = []
        for i in range(pixels.shape[0]):
            run = where[i * n:(i + 1) * n]
            if len(run) != n or run[-1] - run[0] != n - 1:
                raise InvalidRequestError(f"image {i}'s placeholder tokens are not {n} consecutive tokens")
            digest = hashlib.sha256(pixels[i].contiguous().numpy().tobytes()).hexdigest()
            items.append(MultiModalItem(hash=digest, offset=run[0], length=n, pixel_values=pixels[i]))
        return items
