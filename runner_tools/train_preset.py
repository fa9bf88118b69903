"""`python -m runner_tools.train_preset`: trains the shipped `tiny-speaker` preset on the CPU.

Builds the corpus (`runner_tools.corpus`), trains a byte-level BPE tokenizer on it with
`tokenizers`, trains a small transformers `LlamaForCausalLM` with torch (AdamW, warm-up then cosine
decay, loss shown by tqdm) and saves the model in safetensors (bfloat16), its
`PreTrainedTokenizerFast`, a greedy generation config, `training_summary.json` and the corpus's word
list (`corpus_words.txt`, what tests check its greedy text against). A run is
reproducible given `--seed` and `--steps`; with `--minutes` alone the step count is chosen from the
measured speed of the first steps (and written to the summary, so it can be replayed with `--steps`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from runner_core.models.presets import SPECIAL_TOKENS
from runner_tools.corpus import LICENCE, WORDS_FILE, build_corpus, corpus_words, stdlib_dir

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "runner_core" / "models" / "preset_data" / "tiny-speaker"
SAMPLE_PROMPTS = ("The function returns", "This module provides", "If the file")
_TIMING_STEPS = 5  # steps timed to turn --minutes into a step count


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}: pass a number above 0")
        return value
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runner_tools.train_preset", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: the package's)")
    p.add_argument("--minutes", type=_positive(float), default=10.0, help="training time budget (default 10)")
    p.add_argument("--steps", type=_positive(int), help="exact optimizer steps (overrides --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-root", type=Path, default=None, help="Python standard library to read "
                   "(default: this interpreter's)")
    p.add_argument("--tokenizer-from", type=Path, default=None, help="a trained preset's directory whose tokenizer "
                   "is reused instead of training one (a draft model for speculative decoding must share its "
                   "target's vocabulary: --tokenizer-from runner_core/models/preset_data/tiny-speaker)")
    p.add_argument("--vocab-size", type=_positive(int), default=2048)
    p.add_argument("--hidden-size", type=_positive(int), default=128)
    p.add_argument("--layers", type=_positive(int), default=4)
    p.add_argument("--heads", type=_positive(int), default=4)
    p.add_argument("--seq-len", type=_positive(int), default=64)
    p.add_argument("--batch-size", type=_positive(int), default=16)
    p.add_argument("--lr", type=_positive(float), default=5e-3)
    p.add_argument("--threads", type=_positive(int), default=1, help="torch CPU threads (default 1: on a shared "
                   "CPU more threads spin waiting for each other, ~10x the CPU time per step measured)")
    args = p.parse_args(argv)
    if args.hidden_size % args.heads:
        p.error(f"--hidden-size {args.hidden_size} is not a multiple of --heads {args.heads}: pick sizes that divide")
    if args.vocab_size <= 256 + len(SPECIAL_TOKENS):
        p.error(f"--vocab-size {args.vocab_size} leaves no room for merges: use more than {256 + len(SPECIAL_TOKENS)}")
    return args


def train_tokenizer(paragraphs: list[str], vocab_size: int, model_max_length: int):
    """A byte-level BPE tokenizer trained on `paragraphs` (ids 0-2 the special tokens, `<s>` prepended)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(paragraphs, trainer)
    bos = SPECIAL_TOKENS[1]
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=SPECIAL_TOKENS[2],
                                   pad_token=SPECIAL_TOKENS[0], model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)


def token_stream(tokenizer, paragraphs: list[str]) -> torch.Tensor:
    """All paragraphs as one id stream, each `<s> text </s>`."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(paragraphs, add_special_tokens=True)["input_ids"]
    return torch.tensor([t for row in ids for t in (*row, eos)], dtype=torch.long)


def build_model(args: argparse.Namespace, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 11 // 4 // 32 * 32,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def _lr(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train(args: argparse.Namespace) -> dict:
    """Trains and saves the preset under `args.out`; returns the summary (also saved as JSON). Runs on
    `args.threads` torch threads; the caller's thread count and RNG state are restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace) -> dict:
    from transformers import GenerationConfig

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    paragraphs = build_corpus(args.corpus_root)
    if not paragraphs:
        raise SystemExit(f"error: no prose found under {args.corpus_root or stdlib_dir()}: point --corpus-root "
                         "at a Python standard library")
    if args.tokenizer_from is not None:
        from transformers import PreTrainedTokenizerFast
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_from)
    else:
        tokenizer = train_tokenizer(paragraphs, args.vocab_size, 512)
    stream = token_stream(tokenizer, paragraphs)
    if len(stream) <= args.seq_len + 1:
        raise SystemExit(f"error: the corpus has {len(stream)} tokens, fewer than --seq-len {args.seq_len}: "
                         "lower --seq-len or use a larger --corpus-root")
    model = build_model(args, len(tokenizer)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len)

    def step(index: int, total: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = _lr(index, total, args.lr)
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size, 1), generator=batches)
        window = stream[starts + offsets]
        loss = model(input_ids=window, labels=window).loss  # the model shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    setup_s = time.perf_counter() - start
    losses: list[float] = []
    total = args.steps
    with tqdm(desc=f"Training {args.out.name}", unit="step", total=total) as bar:
        if total is None:  # time a few steps (at the warm-up rate of a long run) to fit the budget
            t0 = time.perf_counter()
            for i in range(_TIMING_STEPS):
                losses.append(step(i, 10**6))
                bar.update()
            per_step = (time.perf_counter() - t0) / _TIMING_STEPS
            total = max(_TIMING_STEPS + 1, int((args.minutes * 60 - setup_s) / per_step))
            bar.total = total
        for i in range(len(losses), total):
            losses.append(step(i, total))
            bar.update()
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    train_s = time.perf_counter() - start

    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False)
    samples = {}
    with torch.no_grad():
        for prompt in SAMPLE_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
            samples[prompt] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / WORDS_FILE).write_text("\n".join(sorted(corpus_words(paragraphs))) + "\n")
    tail = losses[-20:]
    summary = {
        "corpus": {"source": "Python standard library docstrings", "licence": LICENCE,
                   "paragraphs": len(paragraphs), "tokens": len(stream)},
        "seed": args.seed, "steps": total, "hidden_size": args.hidden_size, "layers": args.layers,
        "heads": args.heads, "tokenizer_from": None if args.tokenizer_from is None else args.tokenizer_from.name,
        "batch_size": args.batch_size, "seq_len": args.seq_len,
        "parameters": sum(p.numel() for p in model.parameters()),
        "first_loss": losses[0], "final_loss": sum(tail) / len(tail), "train_seconds": round(train_s, 1),
        "losses": [round(x, 4) for x in losses], "samples": samples,
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    summary = train(parse_args(argv))
    print(f"{summary['steps']} steps in {summary['train_seconds']} s, loss {summary['first_loss']:.3f} -> "
          f"{summary['final_loss']:.3f}")
    for prompt, text in summary["samples"].items():
        print(f"  {prompt!r} -> {text!r}")


if __name__ == "__main__":
    main()
