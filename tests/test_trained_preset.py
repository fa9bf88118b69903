"""The shipped `tiny-speaker` preset: found by name, small enough to ship, served by our engine with
transformers' greedy tokens, its greedy text made of the corpus's words; and the script that trains it."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import string

import pytest
import torch
import transformers

from runner_core import ModelRunner, SamplingParams
from runner_core.models.presets import SHIPPED_DIR, ensure_preset, is_preset, preset_names
from runner_tools.corpus import WORDS_FILE, build_corpus, corpus_words, stdlib_dir
from runner_tools.train_preset import main, parse_args, train
from tests.conftest import REPO

PROMPTS = ("The function returns", "This module provides", "Return the", "If the file")
MAX_BYTES = 20 * 2**20


@pytest.fixture(scope="module")
def speaker():
    return ensure_preset("tiny-speaker")


@pytest.fixture(scope="module")
def runner(speaker):
    runner = ModelRunner({"model": "tiny-speaker", "dtype": "float32", "kv_cache_memory": 1 << 22})
    runner.load_model()
    yield runner
    runner.shutdown()


def test_listed_by_name_and_shipped_in_the_package(speaker):
    assert "tiny-speaker" in preset_names() and is_preset("tiny-speaker")
    assert speaker == SHIPPED_DIR / "tiny-speaker"
    files = [p for p in speaker.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES
    assert {p.suffix for p in files} <= {".json", ".safetensors", ".txt"}  # no pickle
    # a non-editable install carries every file: each matches the package data of pyproject.toml
    # (read with a pattern: tomllib is Python 3.11+)
    data = re.search(r"^\[tool\.setuptools\.package-data\]\nrunner_core = (\[.*?\])", (REPO / "pyproject.toml")
                     .read_text(), re.M)
    patterns = ast.literal_eval(data.group(1))
    for p in files:
        assert any(fnmatch.fnmatch(str(p.relative_to(REPO / "runner_core")), pat) for pat in patterns), p


def test_greedy_tokens_equal_transformers(speaker, runner):
    # the weights are stored in bfloat16; both sides cast them to float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(speaker, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(speaker)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = runner.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_greedy_text_is_made_of_the_corpus_words(speaker, runner):
    words = set((speaker / WORDS_FILE).read_text().split())  # written by the training script (checked below)
    assert len(words) > 1000
    outs = runner.generate(list(PROMPTS), SamplingParams(max_tokens=32, temperature=0.0))
    tokens = [t.strip(string.punctuation) for out in outs for t in out.text.split()]
    assert len(tokens) >= 4 * len(PROMPTS), [out.text for out in outs]
    known = [t for t in tokens if t.isalpha() and t.lower() in words]
    assert len(known) >= 0.9 * len(tokens), [out.text for out in outs]
    assert len({t.lower() for t in known}) >= 8, [out.text for out in outs]  # words, not one word repeated


def test_training_script_writes_a_loadable_checkpoint_and_the_loss_falls(tmp_path):
    out = tmp_path / "speaker"
    corpus = stdlib_dir() / "email"
    args = ["--out", str(out), "--steps", "24", "--seed", "3", "--corpus-root", str(corpus),
            "--vocab-size", "384", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
            "--batch-size", "8", "--lr", "1e-2"]
    main(args)
    summary = json.loads((out / "training_summary.json").read_text())
    losses = summary["losses"]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    assert not list(out.glob("*.bin"))
    assert set((out / WORDS_FILE).read_text().split()) == corpus_words(build_corpus(corpus))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf.config.tie_word_embeddings and hf.config.vocab_size == 384
    runner = ModelRunner({"model": str(out), "dtype": "float32", "kv_cache_memory": 1 << 20})
    try:
        runner.load_model()
        assert runner.generate("The message", SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
    finally:
        runner.shutdown()
    # the same seed and step count replay the same run
    again = train(parse_args([*args, "--out", str(tmp_path / "again")]))
    assert again["losses"] == losses


def test_bad_arguments_are_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--hidden-size", "30", "--heads", "4"])
    assert "not a multiple of --heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--minutes", "0"])
    assert "'0' is not a positive float" in capsys.readouterr().err
