"""InputProcessor: any accepted prompt form -> (text, token ids, images), validated, before a
request enters the scheduler (vLLM's input processing). Forms: a str, a list of token ids (or a
1-D tensor), and vLLM's dicts `{"prompt": str}` / `{"prompt_token_ids": [...]}` with optional
`multi_modal_data` (engine/multimodal.py). Each refusal is an InvalidRequestError naming the problem.
"""

from __future__ import annotations

import torch

from runner_core.engine.multimodal import MultiModalItem, MultiModalProcessor, split_prompt
from runner_core.errors import InvalidRequestError


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, model_name: str, multimodal: MultiModalProcessor | None = None):
        self.tokenizer, self.vocab_size, self.model_name = tokenizer, vocab_size, model_name
        self.multimodal = multimodal

    def encode(self, prompt) -> tuple[str | None, list[int], list[MultiModalItem]]:
        content, images = split_prompt(prompt)
        if images:
            if self.multimodal is None:
                raise InvalidRequestError(f"this model ({self.model_name}) takes text only; drop multi_modal_data "
                                          "or load a multimodal model (e.g. the tiny-llava preset)")
            if isinstance(content, str):
                self._check_text(content)
            else:
                content = self._check_ids(content)
            return self.multimodal.process(content, images)
        text, ids = self._encode_text(content)
        mm = self.multimodal
        if mm is not None and mm.image_token_id in ids:
            raise InvalidRequestError(f"the prompt holds image placeholders ({mm.image_token}) but no image; pass the "
                                      "images as multi_modal_data={'image': [...]}, one per placeholder")
        return text, ids, []

    def _check_text(self, text) -> None:
        if not text:
            raise InvalidRequestError("prompt is empty; give at least one character or one token id")

    def _encode_text(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self._check_text(prompt)
            return prompt, self.tokenizer.encode(prompt)
        return None, self._check_ids(prompt)

    def _check_ids(self, prompt) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            raise InvalidRequestError(f"prompt must be a str, a list of token ids or a prompt dict, got "
                                      f"{type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one character or one token id")
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {prompt[bad]} at position {bad} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        return list(prompt)
