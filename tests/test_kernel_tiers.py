"""Choosing the native kernels' instruction-set tier: RUNNER_CORE_CPU_TIER at load (reported by
kernel_tier() and model_info), set_kernel_tier / use_kernel_tier at run time, refusals naming the
tiers this CPU runs, the engine's greedy tokens equal transformers' on every tier and with the kernels
off (the torch fallback), and a build that is the same for every CPU of the architecture."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from runner_core import ModelRunner, SamplingParams, kernels
from runner_core.errors import ConfigError
from runner_core.kernels import build, kernel_info, kernel_tier, kernel_tiers, set_kernel_tier, use_kernel_tier
from runner_core.layers.weight_storage import stored_bytes
from tests.helpers import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 14], list(range(3, 60)), [400, 7], [1]]
NEW_TOKENS = 16
# bfloat16: both engines round activations to 8 mantissa bits at different places, which turns near
# ties later in a generation, so every prompt's first tokens must equal transformers' (measured with
# this model on every tier alike: two prompts equal throughout, two diverging at the 7th and 15th token;
# a tier computing wrongly diverges at the first)
BF16_FIRST_EQUAL = 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiers"), "llama")


def _transformers_greedy(path: Path, dtype: torch.dtype) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]


@pytest.fixture(scope="module")
def transformers_tokens(tiny_llama) -> dict[str, list[list[int]]]:
    return {dtype: _transformers_greedy(tiny_llama, getattr(torch, dtype)) for dtype in ("float32", "bfloat16")}


def _assert_tokens_match(ours: list[list[int]], theirs: list[list[int]], dtype: str) -> None:
    if dtype == "float32":
        assert ours == theirs
    else:
        assert [a[:BF16_FIRST_EQUAL] for a in ours] == [b[:BF16_FIRST_EQUAL] for b in theirs], (ours, theirs)


# ---- the engine in a fresh process: the tier forced at load, and the kernels off -------------------------
ENGINE_SCRIPT = """
import json, sys, torch
from runner_core import ModelRunner, SamplingParams
from runner_core.layers.weight_storage import stored_bytes
runner = ModelRunner({"model": sys.argv[1], "dtype": sys.argv[2], "kv_cache_memory": 1 << 22}).load_model()
outs = runner.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=int(sys.argv[4]), temperature=0.0,
                                                               ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in outs], "cpu_kernels": runner.model_info()["cpu_kernels"],
                  "panel_bytes": stored_bytes(runner.engine.worker.model),
                  "library_loaded": hasattr(torch.ops.runner_kernels, "panel_linear")}))
runner.shutdown()
"""


def _engine_in_a_fresh_process(path: Path, dtype: str, **env: str) -> dict:
    res = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(path), dtype, json.dumps(PROMPTS), str(NEW_TOKENS)],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tier_forced_at_load_runs_and_is_reported_with_its_reason(tiny_llama, transformers_tokens, dtype):
    """RUNNER_CORE_CPU_TIER=plain (the tier every CPU runs, the lowest): the kernels run it from the
    first op, model_info says so and why, and the tokens are transformers'."""
    out = _engine_in_a_fresh_process(tiny_llama, dtype, RUNNER_CORE_CPU_TIER="plain")
    assert out["cpu_kernels"]["tier"] == "plain"
    assert out["cpu_kernels"]["why"] == "RUNNER_CORE_CPU_TIER=plain"
    assert out["cpu_kernels"]["runnable"] == list(kernel_tiers()) and not out["cpu_kernels"]["native_bf16"]
    assert out["panel_bytes"] > 0
    _assert_tokens_match(out["tokens"], transformers_tokens[dtype], dtype)


def test_the_engine_with_the_kernels_off_gives_transformers_tokens(tiny_llama, transformers_tokens):
    """RUNNER_CORE_NO_KERNELS=1: the library is never built or loaded, every op takes its torch path."""
    out = _engine_in_a_fresh_process(tiny_llama, "float32", RUNNER_CORE_NO_KERNELS="1")
    assert not out["library_loaded"] and out["panel_bytes"] == 0
    assert out["cpu_kernels"] == {"tier": "off", "why": "RUNNER_CORE_NO_KERNELS=1", "runnable": [],
                                  "native_bf16": False}
    assert out["tokens"] == transformers_tokens["float32"]


# ---- in this process: switching tiers at run time ---------------------------------------------------------
@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request, tiny_llama):
    runner = ModelRunner({"model": str(tiny_llama), "dtype": request.param, "kv_cache_memory": 1 << 22}).load_model()
    assert stored_bytes(runner.engine.worker.model) > 0  # the linears multiply their panels: the kernels are in use
    yield request.param, runner
    runner.shutdown()


def test_greedy_tokens_equal_transformers_on_every_tier(runner, tier, transformers_tokens):
    dtype, engine = runner
    assert kernel_tier() == tier
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    _assert_tokens_match([o.token_ids for o in outs], transformers_tokens[dtype], dtype)


def test_set_and_use_kernel_tier_switch_and_restore():
    assert kernels.cpu_kernels_available()
    top, why = kernel_tier(), kernel_info()["why"]
    assert top in kernel_tiers() and kernel_tiers()[0] == "plain"
    with use_kernel_tier("plain"):
        assert kernel_tier() == "plain" and kernel_info()["why"] == "set_kernel_tier('plain')"
        set_kernel_tier(top)
        assert kernel_tier() == top and kernel_info()["why"] == f"set_kernel_tier({top!r})"
        set_kernel_tier("plain")
    assert (kernel_tier(), kernel_info()["why"]) == (top, why)
    with pytest.raises(KeyError), use_kernel_tier("plain"):
        raise KeyError("inside the block")
    assert (kernel_tier(), kernel_info()["why"]) == (top, why)  # restored after an error too


def test_an_unknown_tier_is_refused_naming_the_tiers_this_cpu_runs():
    runs, before = ", ".join(kernel_tiers()), (kernel_tier(), kernel_info()["why"])
    with pytest.raises(ConfigError, match=f"set_kernel_tier\\('avx3'\\): 'avx3' is not a kernel tier; this CPU runs "
                                          f"{runs} .* Pick one of those"):
        set_kernel_tier("avx3")
    with pytest.raises(ConfigError, match=f"'avx3' is not a kernel tier; this CPU runs {runs}"), \
            use_kernel_tier("avx3"):
        pass
    assert (kernel_tier(), kernel_info()["why"]) == before


def test_a_tier_this_cpu_cannot_run_is_refused_naming_the_ones_it_runs(monkeypatch):
    """As on an AVX2 CPU (the op reporting only the tiers it runs), avx512 is refused by name."""
    top = kernel_tier()
    monkeypatch.setattr(torch.ops.runner_kernels, "cpu_tiers", lambda: ["plain", "avx2"])
    with pytest.raises(ConfigError, match="'avx512' is a tier this CPU cannot run; this CPU runs plain, avx2 "
                                          "\\(tiers: plain, avx2, avx512, avx512-bf16\\)"):
        set_kernel_tier("avx512")
    assert kernel_tier() == top


@pytest.mark.parametrize("name", ["avx3", "AVX2"])
def test_a_bad_tier_in_the_environment_fails_the_load_naming_the_fix(monkeypatch, name):
    """RUNNER_CORE_CPU_TIER is read when the kernels load: a bad name is an error, not a silent fallback."""
    runs = ", ".join(kernel_tiers())
    monkeypatch.setenv("RUNNER_CORE_CPU_TIER", name)
    monkeypatch.setattr(kernels, "_state", {})
    with pytest.raises(ConfigError, match=f"RUNNER_CORE_CPU_TIER={name}: '{name}' is not a kernel tier; "
                                          f"this CPU runs {runs} "):
        kernels.cpu_kernels_available()


def test_the_build_is_the_same_for_every_cpu_of_the_architecture(monkeypatch, tmp_path):
    """Every tier of the architecture is compiled, whatever this CPU runs, with fixed -m flags (never
    -march=native), and the cache folder is keyed by the sources, torch and the compiler alone."""
    commands: list[list[str]] = []

    def run(command, **_):
        if "--version" in command:
            return SimpleNamespace(returncode=0, stdout="c++ (test) 1.0\n", stderr="")
        commands.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    loads = []
    monkeypatch.setattr(build, "subprocess", SimpleNamespace(run=run))
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: loads.append(kw))
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    build.build()
    expected = list(kernels.TIERS) if platform.machine() in ("x86_64", "AMD64") else ["plain"]
    assert sorted(c[c.index("-c") - 1] for c in commands) == sorted(f'-DRW_TIER_NAME="{t}"' for t in expected)
    flags = [flag for c in commands for flag in c] + loads[0]["extra_cflags"] + loads[0]["extra_ldflags"]
    assert not [flag for flag in flags if "native" in flag or flag.startswith(("-march", "-mtune"))]
    assert build.build_dir().parent == tmp_path / "kernels"
