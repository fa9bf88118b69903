"""How far a model's outputs move from a reference's: the figures that state what a weight storage format
(bf16, int8, int4) costs in quality.

  logit_error(logits, ref)          max and mean |difference| of two logit tensors, beside the reference's
                                    mean |logit| (the scale the error is read against)
  greedy_agreement(forward, ...)    the share of positions where a model's next token (argmax) equals the
                                    reference's greedy token, each position fed the reference's own tokens
                                    before it (teacher forcing: one early difference does not decide the rest)
  held_out_paragraphs()             prose the trained `tiny-speaker` never saw: the same prose filter as its
                                    corpus (runner_tools.corpus), over the standard library's test
                                    folders that the corpus leaves out, minus any paragraph it kept
  token_windows(tokenizer, texts)   those paragraphs as `<s> text </s>` in one stream, cut in windows of the
                                    training length (64 tokens), as the model was trained on them
  perplexity(forward, windows)      exp of the mean next-token negative log-likelihood over the windows

`forward` is any callable from a [B, T] LongTensor of token ids to [B, T, V] logits: a ModelRunner's
`lambda ids: runner.forward(ids)["logits"]`, or a transformers model's `.logits`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from runner_tools.corpus import build_corpus, docstrings, prose_paragraphs, stdlib_dir

Forward = Callable[[torch.Tensor], torch.Tensor]
TRAIN_WINDOW = 64  # tiny-speaker's training sequence length (runner_tools/train_preset.py --seq-len)
_HELD_OUT_DIRS = {"test", "tests", "idle_test", "lib2to3"}  # left out of the corpus, same prose style


def logit_error(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """{"max", "mean"}: |logits - ref| over every element; "ref_mean_abs": the reference's mean |logit|."""
    if logits.shape != ref.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot be compared with a reference of shape "
                         f"{tuple(ref.shape)}: run both on the same token ids")
    diff = (logits.float() - ref.float()).abs()
    return {"max": diff.max().item(), "mean": diff.mean().item(), "ref_mean_abs": ref.float().abs().mean().item()}


@torch.inference_mode()
def greedy_agreement(forward: Forward, prompts: list[list[int]], ref_tokens: list[list[int]]) -> dict:
    """Teacher-forced agreement with a reference's greedy continuations: each prompt followed by the
    reference's tokens is run once; position p's argmax is compared with the reference's token p.
    {"agree": positions equal, "total": positions, "fraction", "identical": continuations equal whole}."""
    agree = total = identical = 0
    for prompt, ref in zip(prompts, ref_tokens, strict=True):
        if not ref:
            continue
        ids = torch.tensor([prompt + ref[:-1]])
        logits = forward(ids)[0, len(prompt) - 1:]
        same = logits.argmax(dim=-1) == torch.tensor(ref, device=logits.device)
        agree += int(same.sum())
        total += len(ref)
        identical += bool(same.all())
    return {"agree": agree, "total": total, "fraction": agree / total if total else float("nan"),
            "identical": identical}


def _held_out_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if _HELD_OUT_DIRS.intersection(p.relative_to(root).parts[:-1])
                  and not {"site-packages", "dist-packages"}.intersection(p.relative_to(root).parts))


def held_out_paragraphs(limit: int = 400, root: Path | None = None) -> list[str]:
    """Up to `limit` prose paragraphs (in a fixed order) from the standard library's test folders, none of
    which is in tiny-speaker's training corpus."""
    root = root or stdlib_dir()
    seen = set(build_corpus(root))
    out: dict[str, None] = {}
    for path in _held_out_files(root):
        for doc in docstrings(path):
            for paragraph in prose_paragraphs(doc):
                if paragraph not in seen:
                    out.setdefault(paragraph, None)
                    if len(out) == limit:
                        return list(out)
    if not out:
        raise FileNotFoundError(f"no test folders with prose under {root} (some distributions strip them): "
                                "pass the text to token_windows yourself")
    return list(out)


def token_windows(tokenizer, texts: list[str], window: int = TRAIN_WINDOW) -> torch.Tensor:
    """[N, window] token ids from a transformers tokenizer (a ModelRunner's `runner.tokenizer.hf`): every text
    as `<s> text </s>` in one stream (train_preset's token_stream), cut into whole windows (a last partial
    one is dropped)."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    stream = torch.tensor([t for row in ids for t in (*row, eos)], dtype=torch.long)
    n = len(stream) // window
    if n == 0:
        raise ValueError(f"{len(stream)} tokens make no whole window of {window}: pass more text")
    return stream[:n * window].view(n, window)


@torch.inference_mode()
def perplexity(forward: Forward, windows: torch.Tensor, batch: int = 16) -> float:
    """exp(mean negative log-likelihood of each window's tokens 2..T given those before), as training scored."""
    nll, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = forward(chunk)[:, :-1].float()
        targets = chunk[:, 1:].to(logits.device)
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 reduction="sum").item()
        count += targets.numel()
    return float(torch.exp(torch.tensor(nll / count)))
