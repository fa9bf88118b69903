"""Tokenizer seen by the engine: a Hugging Face tokenizer, or a byte-level fallback
for model directories without tokenizer files, plus cheap incremental detokenization."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from runner_core.errors import InvalidRequestError, ModelLoadError

# Any of these next to config.json means the directory ships its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0, 1, 2 are pad, bos, eos and byte b is id b + 3.

    Usable when the model's vocabulary has room for the 259 ids; with a smaller
    one, text cannot be encoded and decoding renders ids as "<id>".
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
    OFFSET = len(SPECIAL_TOKENS)

    def __init__(self, model_vocab_size: int) -> None:
        self.model_vocab_size = model_vocab_size
        self.encodes_text = model_vocab_size >= self.OFFSET + 256

    def __len__(self) -> int:
        return self.OFFSET + 256 if self.encodes_text else self.model_vocab_size

    def encode(self, text: str) -> list[int]:
        if not self.encodes_text:
            raise InvalidRequestError(
                f"this model has no tokenizer and its vocabulary ({self.model_vocab_size} ids) is too small "
                f"for the byte-level fallback ({self.OFFSET + 256} ids): pass token ids instead of text"
            )
        return [self.bos_token_id, *(b + self.OFFSET for b in text.encode("utf-8"))]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if not self.encodes_text:
            return "".join(f"<{i}>" for i in ids)
        out, data = [], bytearray()
        for i in ids:
            if self.OFFSET <= i < self.OFFSET + 256:
                data.append(i - self.OFFSET)
                continue
            out.append(data.decode("utf-8", errors="replace"))
            data.clear()
            if i >= self.OFFSET:  # beyond the bytes: a model id with no text
                out.append(f"<{i}>")
            elif not skip_special_tokens:
                out.append(self.SPECIAL_TOKENS[i])
        out.append(data.decode("utf-8", errors="replace"))
        return "".join(out)


class Tokenizer:
    """The engine's tokenizer interface over a Hugging Face tokenizer or a ByteTokenizer."""

    def __init__(self, backend, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self._backend = backend
        eos = {backend.eos_token_id} if backend.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(extra_eos_token_ids))
        self.bos_token_id: int | None = backend.bos_token_id
        self.pad_token_id: int | None = backend.pad_token_id
        self.vocab_size: int = len(backend)

    @property
    def hf(self):
        """The underlying Hugging Face tokenizer, or None for the byte fallback."""
        return None if isinstance(self._backend, ByteTokenizer) else self._backend

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS when the tokenizer adds it by default."""
        return list(self._backend.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence, decoding a short window per step.

    As in vLLM: decode ids[prefix_offset:] and subtract the text of
    ids[prefix_offset:read_offset], so tokenizers whose pieces depend on their left
    context (leading spaces) come out right. A delta ending in U+FFFD is held back:
    it is a multi-byte character split across tokens whose remaining bytes are
    still to come.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.text = ""

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the newly completed text (possibly "")."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def has_tokenizer_files(path: Path) -> bool:
    return any((path / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path, hf_config, trust_remote_code: bool = False) -> Tokenizer:
    """The tokenizer stored in `path`, or a ByteTokenizer when it holds none.

    EOS ids are the union of the tokenizer's, config.json's and generation_config.json's.
    """
    path = Path(path)
    extra_eos = _eos_ids(getattr(hf_config, "eos_token_id", None)) | _generation_config_eos(path)
    if not has_tokenizer_files(path):
        return Tokenizer(ByteTokenizer(hf_config.get_text_config().vocab_size), extra_eos)
    from transformers import AutoTokenizer  # heavy: only when there is a tokenizer to load

    try:
        hf = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError, ...
        raise ModelLoadError(
            f"cannot load the tokenizer in {path}: {exc}. Check its tokenizer files "
            f"({', '.join(TOKENIZER_FILES)}); a tokenizer with custom code needs trust_remote_code=True"
        ) from exc
    return Tokenizer(hf, extra_eos)


def _eos_ids(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _generation_config_eos(path: Path) -> set[int]:
    file = path / "generation_config.json"
    if not file.is_file():
        return set()
    try:
        return _eos_ids(json.loads(file.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON with an integer or list 'eos_token_id': {exc}") from exc
