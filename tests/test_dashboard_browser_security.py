"""The served dashboard in Chromium: generated text and model names that look like HTML are shown as
text (nothing executes), and two browser sessions open at once each see their own generations."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runner_core import ModelRunner, SamplingParams
from tests.test_workbench_browser import CHROMIUM, CHROMIUM_ARGS, SLOW, _require_browser

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "test-output" / "workbench"
PAYLOADS = ("<script>window.__xss = {i}</script>", "<img src=x onerror=\"window.__xss = {i}\">")
NAME = "<img src=x onerror=\"window.__xss = 'name'\">"


def hostile_model(tiny_llama_path: Path, root: Path) -> Path:
    """tiny-llama with a word-level tokenizer whose every token is an HTML payload, in a folder whose
    name is one too: whatever it generates, and its name, would run if rendered as HTML."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = json.loads((tiny_llama_path / "config.json").read_text())["vocab_size"]
    vocab = {PAYLOADS[i % 2].format(i=i): i for i in range(vocab_size)}
    # any typed word is token 0, itself a payload (not declared special, so decoding keeps it)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAYLOADS[0].format(i=0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = root / NAME
    shutil.copytree(tiny_llama_path, path, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def _serve(*args: str):
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--port", "0", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    url, lines, found = [], [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"Workbench dashboard: (http://\S+)", line)
            if m and not url:
                url.append(m.group(1))
                found.set()
    threading.Thread(target=read, daemon=True).start()
    if not found.wait(180):
        proc.kill()
        pytest.fail("the server printed no URL:\n" + "".join(lines))
    return proc, url[0]


def _generate(page, prompt: str, max_tokens: int) -> None:
    page.locator(".wb-prompt textarea").fill(prompt)
    for field, value in ((".wb-max-tokens input", str(max_tokens)), (".wb-temperature input", "0")):
        page.locator(field).fill(value)
        page.locator(field).press("Enter")
    page.get_by_role("button", name="Generate").click()


def test_html_in_generated_text_and_model_names_is_shown_as_text(tiny_llama_path, tmp_path):
    sync_api = _require_browser()
    from playwright.sync_api import expect

    path = hostile_model(tiny_llama_path, tmp_path)
    proc, url = _serve("--model", str(path), "--model-root", str(tmp_path))
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.goto(url, timeout=SLOW)
            expect(page.locator(".wb-models")).to_contain_text(NAME, timeout=SLOW)  # the name, as text
            _generate(page, "hello", 12)
            expect(page.locator(".wb-answer-stats")).to_contain_text("finished", timeout=SLOW)
            answer = page.locator(".wb-answer pre").inner_text()
            assert "window.__xss" in answer and ("<script>" in answer or "<img" in answer)
            page.screenshot(path=str(OUT / "dashboard-hostile-text.png"), full_page=True)
            assert page.evaluate("typeof window.__xss") == "undefined"  # nothing ran
            assert page.locator(".wb-answer script, .wb-answer img, .wb-models img").count() == 0
            browser.close()
    finally:
        proc.terminate()
        proc.wait(15)


def test_two_browser_sessions_each_see_their_own_generations():
    sync_api = _require_browser()
    from playwright.sync_api import expect

    # the trained preset: its text is words, so the page's text is compared without byte-soup decoding
    prompts = {"a": "The function returns", "b": "If the file"}
    runner = ModelRunner({"model": "tiny-speaker", "dtype": "float32"}).load_model()
    expected = {k: runner.generate(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].text
                for k, p in prompts.items()}
    runner.shutdown()
    assert expected["a"] != expected["b"]
    proc, url = _serve("--model", "tiny-speaker")
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            pages = {k: browser.new_context(viewport={"width": 1400, "height": 1200}).new_page() for k in prompts}
            for page in pages.values():
                page.goto(url, timeout=SLOW)
                expect(page.locator(".wb-status")).to_contain_text("active model", timeout=SLOW)
                page.locator(".wb-ignore-eos input").check()
            for k, page in pages.items():  # both run at once: one engine batches them
                _generate(page, prompts[k], 40)
            for k, page in pages.items():
                expect(page.locator(".wb-answer-stats")).to_contain_text("finished", timeout=SLOW)
                assert page.locator(".wb-answer pre").inner_text() == expected[k]
            browser.close()
    finally:
        proc.terminate()
        proc.wait(15)
