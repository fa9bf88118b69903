"""EncoderCache: image features by the image's content hash, computed once and reused by every
request (and every later prefill chunk) that shows the same image; least recently used entries
are dropped beyond `capacity_tokens` feature rows (0 keeps nothing: every step that needs an
image encodes it again). Owned by the Worker; the scheduler asks `__contains__` before it splits
an image's placeholders across prefill chunks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self.hits = self.misses = 0  # images looked up by a step, found / encoded

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def features(self, items: Sequence[tuple[str, torch.Tensor]],
                 encode: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """{hash: features [tokens, hidden]} for (hash, pixel values) items: cached ones as they
        are, the rest through one `encode(pixels [n, 3, H, W])` call, then kept if they fit."""
        found, missing = {}, {}
        for digest, pixels in items:
            if digest in self._entries:
                self._entries.move_to_end(digest)
                found[digest] = self._entries[digest]
            elif digest not in missing:
                missing[digest] = pixels
        self.hits += len(found)
        self.misses += len(missing)
        if missing:
            encoded = encode(torch.stack(list(missing.values())))
            for digest, features in zip(missing, encoded):
                found[digest] = features
                self._keep(digest, features)
        return found

    def _keep(self, digest: str, features: torch.Tensor) -> None:
        rows = features.shape[0]
        if rows > self.capacity_tokens:
            return
        while self.num_tokens + rows > self.capacity_tokens:
            _, old = self._entries.popitem(last=False)
            self.num_tokens -= old.shape[0]
        self._entries[digest] = features
        self.num_tokens += rows

    def stats(self) -> dict:
        return {"capacity_tokens": self.capacity_tokens, "tokens": self.num_tokens, "images": len(self._entries),
                "hits": self.hits, "misses": self.misses}
