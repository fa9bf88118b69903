"""The served dashboard in Chromium: generated text and model names that look like HTML are shown as
text (nothing executes), and two browser sessions open at once each see their own generations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runner_core import ModelRunner, SamplingParams
from tests.dashboard_server import served_dashboard
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
    with served_dashboard("--model", str(path), "--model-root", str(tmp_path)) as url:
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
    with served_dashboard("--model", "tiny-speaker") as url:
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
