"""`SpeculativeConfig`: the `speculative_config` field of RunnerConfig read and checked (vLLM's names), and the
combinations speculation does not run with refused, each error naming the problem and the fix.

The field itself stays a plain dict (normalised: every key present), so a config remains JSON and compares by
value; `SpeculativeConfig.of(config)` gives the typed view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from runner_core.errors import ConfigError

METHODS = ("ngram", "draft_model")
LATER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN = 4, 2  # this project's defaults when the keys are left out
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
FIELD = "speculative_config"


def _bad(what: str, allowed: str) -> ConfigError:
    return ConfigError(f"config field {FIELD!r}: {what}; allowed: {allowed}")


def _int(raw: Mapping, key: str, default: int | None, lo: int, hi: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(f"{key!r} got {value!r}", f"an int from {lo} to {hi}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings: `method` ("ngram", prompt lookup, or "draft_model", implied by `model`),
    `num_speculative_tokens` (k, the drafts proposed per sequence per step, 1..16), for ngram the n-gram lengths
    looked up, `prompt_lookup_max` down to `prompt_lookup_min` (left out: 4 and 2; one given alone bounds the
    other), for draft_model the draft's `model` (a preset name or a directory, the target's vocabulary)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    model: str | None = None

    @classmethod
    def check(cls, value: Any) -> dict | None:
        """`value` (None, a dict or a SpeculativeConfig) as the normalised dict RunnerConfig keeps; ConfigError
        naming the problem and the fix."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            value = asdict(value)
        if not isinstance(value, Mapping):
            raise _bad(f"got {value!r}", 'None (off) or a dict such as {"method": "ngram", '
                                         '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
        unknown = [k for k in value if k not in KEYS]
        if unknown:
            raise _bad(f"unknown key {unknown[0]!r}", "the keys " + ", ".join(map(repr, KEYS)))
        model = value.get("model")
        method = value.get("method", "ngram" if model is None else "draft_model")
        if method == "model":  # vLLM's older spelling
            method = "draft_model"
        if method in LATER_METHODS:
            raise _bad(f"method {method!r} is not implemented yet", 'method "ngram" (prompt lookup: drafts '
                       'copied from the prompt and output so far) or "draft_model" with a draft "model"')
        if method not in METHODS:
            raise _bad(f"method {method!r} is unknown", "one of " + ", ".join(map(repr, METHODS)))
        if "num_speculative_tokens" not in value:
            raise _bad("'num_speculative_tokens' is required", f"an int from 1 to {MAX_SPECULATIVE_TOKENS}, "
                       "the draft tokens proposed per sequence per step")
        k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        given_min = _int(value, "prompt_lookup_min", 1, 1, 64) if "prompt_lookup_min" in value else None
        given_max = _int(value, "prompt_lookup_max", 1, 1, 64) if "prompt_lookup_max" in value else None
        lookup_max = given_max if given_max is not None else max(DEFAULT_LOOKUP_MAX, given_min or 0)
        lookup_min = given_min if given_min is not None else min(DEFAULT_LOOKUP_MIN, lookup_max)
        if lookup_min > lookup_max:
            raise _bad(f"prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}",
                       "prompt_lookup_min <= prompt_lookup_max (the n-gram lengths looked up, longest first)")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise _bad(f"method 'draft_model' with 'model' {model!r}", "a draft model's preset name or directory "
                       'as "model", e.g. {"model": "tiny-speaker-draft", "num_speculative_tokens": 4}')
        if method == "ngram" and model is not None:
            raise _bad(f"method 'ngram' with a draft 'model' {model!r}", 'method "draft_model" (or no method) '
                       "with a model, or method \"ngram\" without one")
        normalised = asdict(cls(method, k, lookup_max, lookup_min, model))
        if model is None:  # an n-gram config keeps its four keys
            del normalised["model"]
        return normalised

    @classmethod
    def of(cls, config) -> SpeculativeConfig | None:
        """The typed settings of a RunnerConfig, None when speculation is off."""
        raw = config.speculative_config
        return None if raw is None else cls(**raw)


def check_speculative_config(config) -> dict | None:
    """A RunnerConfig's `speculative_config` checked (`SpeculativeConfig.check`) and normalised; the other settings
    speculation cannot run with yet refused (ConfigError naming them)."""
    value = SpeculativeConfig.check(config.speculative_config)
    if value is not None and value.get("model") is not None and config.world_size > 1:
        raise ConfigError(f"config field {FIELD!r} has a draft model with tensor_parallel_size="
                          f"{config.tensor_parallel_size}, pipeline_parallel_size={config.pipeline_parallel_size}: "
                          "a draft model runs in one process only; use tensor_parallel_size=1 and "
                          "pipeline_parallel_size=1, or method 'ngram'")
    if value is not None and config.pipeline_parallel_size > 1:
        raise ConfigError(f"config field {FIELD!r} is set with pipeline_parallel_size="
                          f"{config.pipeline_parallel_size}: speculative decoding does not run over pipeline stages "
                          "yet; use pipeline_parallel_size=1 or speculative_config=None")
    return value
