"""Which Hugging Face causal LMs the transformers fallback can run, decided before anything is built.

* `fallback_architectures()`: the causal-LM classes of transformers whose modeling source declares
  `_supports_attention_backend = True` (what `supported_architectures()` lists as "transformers").
  It reads transformers' name mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, no modeling import) and
  scans each model's `modeling_*.py` text once (~30 ms for ~200 files); importing the modeling
  modules instead would take minutes. It is a listing: loading checks the class itself.
* `resolve_fallback(hf_config, trust_remote_code)`: the transformers class for a checkpoint and
  why it qualifies, or a ModelLoadError naming the architecture and what would work: the class
  must declare `_supports_attention_backend` (its attention then goes through
  `AttentionInterface`, where the runner's paged attention is registered), remote code needs
  `trust_remote_code=True`, and the config must not ask for what one paged step cannot express
  (attention or final-logit softcapping, a mix of sliding and full attention layers). Checks that
  need the built model (per-layer windows, attention biases, post-processed logits) are made by
  the model's probe (transformers_backend.py).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from runner_core.errors import ModelLoadError

_DECLARES = re.compile(r"^\s+_supports_attention_backend\s*=\s*True", re.MULTILINE)
# fields the engine reads from the config itself (worker, tokenizer, memory plan)
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings")
WHAT_WORKS = ("a native adapter (runner_core.register_model) or an architecture listed by "
              "runner_core.supported_architectures()")


def _causal_lm_names() -> dict[str, str]:
    """model_type -> causal-LM class name, from transformers' auto mapping (names only)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: v if isinstance(v, str) else v[0] for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


@functools.lru_cache(maxsize=1)
def fallback_architectures() -> tuple[str, ...]:
    """Causal-LM class names whose modeling source declares `_supports_attention_backend = True`."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    root = Path(transformers.__file__).parent / "models"
    out = set()
    for model_type, cls in _causal_lm_names().items():
        module = model_type_to_module_name(model_type)
        source = root.joinpath(*module.split(".")) / f"modeling_{module.split('.')[-1]}.py"
        try:
            text = source.read_text()
        except OSError:
            continue  # a model type reusing another module's class: listed under that one
        if f"class {cls}(" in text and _DECLARES.search(text):
            out.add(cls)
    return tuple(sorted(out))


def _names(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or [f"model_type={getattr(hf_config, 'model_type', None)}"]
    return ", ".join(archs)


def _hf_class(hf_config, architectures: list[str], trust_remote_code: bool) -> tuple[str, type]:
    """(architecture, transformers class) for the checkpoint, chosen as transformers' Auto class
    would: its remote code when the user trusts it, else a causal LM of transformers."""
    import transformers

    names = _causal_lm_names()
    known = set(names.values())
    remote = (getattr(hf_config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    local = next((a for a in architectures if a in known), None)
    if local is None and not getattr(hf_config, "architectures", None):
        local = names.get(getattr(hf_config, "model_type", None))
    if remote and (trust_remote_code or local is None):
        arch = next((a for a in architectures if not a.startswith("model_type=")), remote)
        if not trust_remote_code:
            raise ModelLoadError(
                f"architecture {arch!r} is remote code (config.json's auto_map: AutoModelForCausalLM -> {remote!r}), "
                "which runs only with trust_remote_code=True; pass trust_remote_code=True if you trust that code "
                f"(it then runs through the transformers fallback), or use {WHAT_WORKS}")
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        try:
            return arch, get_class_from_dynamic_module(remote, hf_config._name_or_path)
        except Exception as exc:  # a missing file, an error in the remote module, ...
            raise ModelLoadError(f"cannot import the remote code {remote!r} of architecture {arch!r}: {exc}") from exc
    if local is not None:
        return local, getattr(transformers, local)
    raise ModelLoadError(
        f"architecture {_names(hf_config)!r} is neither registered natively nor a causal LM of transformers "
        f"{transformers.__version__}, so the transformers fallback cannot build it; use {WHAT_WORKS}")


def config_problem(hf_config) -> str | None:
    """What in the config one paged step cannot express, or None."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if text is not hf_config:
        return ("its config nests a text model (a multimodal or composite model); the fallback runs text-only "
                "causal LMs whose config holds the decoder's fields")
    missing = [f for f in _REQUIRED_FIELDS if getattr(hf_config, f, None) is None]
    if missing:
        return f"its config has no {', '.join(missing)} (the runner reads these to size the model and its KV cache)"
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf_config, field, None):
            return (f"it uses {field}={getattr(hf_config, field)} (softcapping), which the runner's paged attention "
                    "and LM head do not apply")
    types = set(getattr(hf_config, "layer_types", None) or ())
    if len(types) > 1:
        return (f"its layer_types mix {', '.join(sorted(types))}: per-layer sliding windows, while one paged step "
                "applies one window to every layer")
    return None


def resolve_fallback(hf_config, architectures: list[str], trust_remote_code: bool = False) -> tuple[str, type, str]:
    """(architecture, transformers class, why it qualifies) for running `hf_config` through the
    fallback; ModelLoadError naming the architecture and what would work otherwise."""
    arch, cls = _hf_class(hf_config, architectures, trust_remote_code)
    if not getattr(cls, "_supports_attention_backend", False):
        raise ModelLoadError(
            f"architecture {arch!r} cannot run through the transformers fallback: its transformers class "
            f"{cls.__name__} does not declare _supports_attention_backend, so its attention cannot be routed to "
            f"the runner's paged KV cache; use {WHAT_WORKS}")
    problem = config_problem(hf_config)
    if problem:
        raise ModelLoadError(f"architecture {arch!r} cannot run through the transformers fallback: {problem}; "
                             f"use {WHAT_WORKS}")
    return arch, cls, f"transformers class {cls.__name__} declares _supports_attention_backend"
