"""TransformersForCausalLM: a Hugging Face causal LM run on the runner's paged KV cache, scheduler,
sampler and compile path (vLLM's "Transformers backend"). Which classes qualify: transformers_compat.

The transformers model is built from a deep copy of the checkpoint's config with
`attn_implementation=ATTN_NAME`, the name under which the runner's paged attention is registered in
transformers' `AttentionInterface` (weights left uninitialised: the checkpoint fills them). A probe
forward at build time records which modules call attention, in order, with their heads, head size,
scaling and per-layer arguments (sliding window, softcap, sinks, mask); what one paged step cannot
express is refused there. Each of those modules gets a runner `Attention` child (`runner_attn`),
which the registered function calls, so `bind_kv_cache` binds every layer's slice of the pool in
model order and compiled programs see the same `runner_core::paged_attention` op as a native model.

A step calls the base model on the flat batch as one row: `input_ids [1, N]`, `position_ids [1, N]`,
`use_cache=False` and no mask (the step's attention metadata says which keys each query sees). The
LM head is the runner's (`compute_logits`), sampling the engine's. Parameter names are the
checkpoint's (`<base_model_prefix>.…`, `lm_head.…`), so `load_weights` copies HF names directly.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import re
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runner_core.distributed.parallel_state import get_pp_stage, get_tp_size
from runner_core.layers.attention import Attention
from runner_core.layers.embedding import ParallelLMHead
from runner_core.layers.linear import default_weight_loader
from runner_core.models.transformers_compat import WHAT_WORKS

ATTN_NAME = "runner_core_paged"
# checkpoint tensors that are not model state: rotary tables, legacy GPT-2 causal-mask buffers
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.masked_bias|\.attn\.bias)$")
_PROBE_TOKENS = 3


@dataclass
class _Call:
    """One attention call seen by the probe."""

    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    scaling: float | None
    dropout: float
    mask: torch.Tensor | None
    kwargs: dict


_PROBE: ContextVar[list[_Call] | None] = ContextVar("runner_core_transformers_probe", default=None)


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the runner's paged attention: q [1, H, N, D],
    k/v [1, KVH, N, D] after rope -> ([1, N, H, D], None)."""
    n = query.shape[2]
    probe = _PROBE.get()
    if probe is not None:
        probe.append(_Call(module, query.shape[1], key.shape[1], query.shape[-1], value.shape[-1], scaling, dropout,
                           attention_mask, dict(kwargs)))
        return query.new_zeros(1, n, query.shape[1], value.shape[-1]), None
    attn = module._modules.get("runner_attn")
    if attn is None:
        raise RuntimeError(f"{type(module).__name__} runs attention {ATTN_NAME!r} without a runner Attention; build "
                           "the model through runner_core (TransformersForCausalLM)")
    out = attn(query.transpose(1, 2).reshape(n, -1).contiguous(), key.transpose(1, 2).reshape(n, -1),
               value.transpose(1, 2).reshape(n, -1))
    return out.view(1, n, attn.num_heads, attn.head_dim), None


@functools.cache
def register_attention() -> None:
    """Register `paged_attention_forward` as ATTN_NAME in transformers' (global) AttentionInterface.
    It is not a mask function name, so transformers builds no mask for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def _is_plain_causal(mask: torch.Tensor, n: int) -> bool:
    """Whether a mask a model built itself is the plain causal one (boolean, or 0 / very negative)."""
    m = mask.reshape(-1, *mask.shape[-2:])[:, -n:, -n:]
    causal = torch.ones(n, n, dtype=torch.bool, device=m.device).tril()
    if m.dtype == torch.bool:
        return bool((m == causal).all())
    return bool(((m == 0) == causal).all()) and bool((m[:, ~causal] < -1e3).all())


def _source_digest(hf_class: type) -> str:
    """transformers' version and the modeling source of `hf_class` (its module and the modules of its
    bases): compiled programs trace that code, so the compile cache key includes it."""
    import sys

    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for module in sorted({c.__module__ for c in hf_class.__mro__ if c.__module__.startswith("transformers")}):
        file = getattr(sys.modules.get(module), "__file__", None)
        if file:
            h.update(Path(file).read_bytes())
    return h.hexdigest()[:16]


def _weight_conversions(causal: nn.Module) -> tuple[list, list]:
    """transformers' checkpoint conversions for this model: (renamings, converters). `save_pretrained`
    writes some legacy names (GPT-NeoX's `embed_out`), which loading renames back; converters
    (tensors merged or split, e.g. MoE experts) are not applied by the fallback (refused at load)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # another transformers layout: checkpoint names are used as they are
        return [], []
    transforms = get_model_conversion_mapping(causal)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


class _LMHead(ParallelLMHead):
    """The runner's LM head, with the bias some families have (Phi, GPT-J)."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool):
        super().__init__(vocab_size, hidden_size)
        self.register_parameter("bias", nn.Parameter(torch.empty(vocab_size), requires_grad=False) if bias else None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        return logits if self.bias is None else logits + self.bias


class TransformersForCausalLM(nn.Module):
    """The fallback's model class (one subclass per transformers class: `for_class`), following the
    model contract of LlamaForCausalLM: forward(input_ids [N], positions [N]) -> hidden [N, H],
    compute_logits, load_weights, num_layers / num_kv_heads / head_dim / sliding_window.
    Compiles with scope "model" only (`compile_scopes`)."""

    hf_class: type | None = None
    compile_scopes = ("model",)

    @classmethod
    @functools.cache
    def for_class(cls, hf_class: type) -> type:
        return type(cls.__name__, (cls,), {"hf_class": hf_class, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})

    def __init__(self, config):
        super().__init__()
        if self.hf_class is None:
            raise ValueError("TransformersForCausalLM is built per transformers class: use "
                             "TransformersForCausalLM.for_class(cls) (the adapter registry does)")
        arch = self.hf_class.__name__
        stage = get_pp_stage()
        if get_tp_size() > 1 or (stage is not None and stage.size > 1):
            raise ValueError(f"{arch} runs through the transformers fallback, which runs on one device "
                             "(tensor_parallel_size=1, pipeline_parallel_size=1)")
        register_attention()
        causal = self._build(config)
        self.base_model_name = causal.base_model_prefix
        base = getattr(causal, self.base_model_name, None)
        head = causal.get_output_embeddings()
        if base is None or not isinstance(head, nn.Linear):
            raise ValueError(f"{arch} has no base model at {self.base_model_name!r} or no linear LM head; "
                             f"use {WHAT_WORKS}")
        if "position_ids" not in inspect.signature(base.forward).parameters:
            raise ValueError(f"{arch}'s base model takes no position_ids, which the flat batch needs; use {WHAT_WORKS}")
        calls = self._probe(causal, head)
        self._renamings, self._converters = _weight_conversions(causal)
        self.add_module(self.base_model_name, base)
        # the head under its transformers name (lm_head, embed_out, ...), so checkpoint names match
        self.head_name = next(name for name, m in causal.named_children() if m is head)
        lm_head = _LMHead(head.out_features, head.in_features, head.bias is not None)
        self.add_module(self.head_name, lm_head)
        self.tie_word_embeddings = head.weight is causal.get_input_embeddings().weight
        if self.tie_word_embeddings:
            lm_head.weight = base.get_input_embeddings().weight
        for c in calls:
            scale = c.scaling if c.scaling is not None else c.head_dim ** -0.5
            c.module.runner_attn = Attention(c.num_heads, c.head_dim, scale, c.num_kv_heads)
        if [m for m in self.modules() if isinstance(m, Attention)] != [c.module.runner_attn for c in calls]:
            raise ValueError(f"{arch} calls its attention modules in another order than it holds them, so the KV "
                             f"pool's layers would not match; use {WHAT_WORKS}")
        self.requires_grad_(False)
        self.compile_key = _source_digest(self.hf_class)
        first = calls[0]
        self.num_layers, self.num_kv_heads, self.head_dim = len(calls), first.num_kv_heads, first.head_dim
        self.sliding_window = first.kwargs.get("sliding_window")

    def _build(self, config) -> nn.Module:
        """The transformers model from a deep copy of `config` (from_config writes the attention
        name into it), in the default dtype on the default device, its weights not initialised."""
        from transformers.initialization import no_init_weights

        with no_init_weights():
            causal = self.hf_class._from_config(copy.deepcopy(config), attn_implementation=ATTN_NAME,
                                                dtype=torch.get_default_dtype())
        causal.tie_weights()
        return causal.eval()

    def _probe(self, causal: nn.Module, head: nn.Module) -> list[_Call]:
        """Run the whole transformers model once on a few tokens, recording the attention calls;
        refuse what one paged step cannot express (ValueError naming the architecture)."""
        arch = self.hf_class.__name__
        device = next(causal.parameters()).device
        ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=device)
        calls: list[_Call] = []
        head_out: list[torch.Tensor] = []
        hook = head.register_forward_hook(lambda m, args, out: head_out.append(out))
        token = _PROBE.set(calls)
        try:
            with torch.no_grad():
                out = causal(input_ids=ids, position_ids=torch.arange(_PROBE_TOKENS, device=device)[None],
                             use_cache=False)
        finally:
            _PROBE.reset(token)
            hook.remove()

        def refuse(what: str):
            raise ValueError(f"{arch} cannot run through the transformers fallback: {what}; use {WHAT_WORKS}")

        if not calls:
            refuse(f"no module called the attention interface ({ATTN_NAME!r})")
        if len(head_out) != 1 or getattr(out, "logits", None) is not head_out[0]:
            refuse("its forward post-processes the LM head's logits (scaling or softcapping), which the "
                   "runner's LM head does not apply")
        if len({id(c.module) for c in calls}) != len(calls):
            refuse("one attention module runs at several layers (shared layers need one KV cache each)")
        if len({(c.num_heads, c.num_kv_heads, c.head_dim) for c in calls}) > 1:
            refuse("its layers have different head counts or head sizes (the KV pool holds one shape per layer)")
        for i, c in enumerate(calls):
            if c.value_dim != c.head_dim or c.kwargs.get("is_causal") is False:
                refuse(f"layer {i} attends with value size {c.value_dim} != key size {c.head_dim} or not causally")
            if c.kwargs.get("softcap"):
                refuse(f"layer {i} applies attention softcapping (softcap={c.kwargs['softcap']})")
            if c.kwargs.get("s_aux") is not None or c.kwargs.get("sinks") is not None:
                refuse(f"layer {i} uses attention sinks")
            if c.mask is not None and not _is_plain_causal(c.mask, _PROBE_TOKENS):
                refuse(f"layer {i} builds its own attention bias (e.g. ALiBi), which paged attention does not add")
        windows = [c.kwargs.get("sliding_window") for c in calls]
        if len(set(windows)) > 1:
            refuse(f"its layers use different sliding windows ({windows}: per-layer sliding windows), while one "
                   "paged step applies one window to every layer")
        return calls

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, H] of a flat batch (attention metadata and the KV pool come from the
        forward context)."""
        out = self._modules[self.base_model_name](input_ids=input_ids.unsqueeze(0),
                                                  position_ids=positions.unsqueeze(0), use_cache=False)
        return out[0][0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._modules[self.head_name].compute_logits(hidden_states)

    def _rename(self, name: str) -> str:
        """The model's name for checkpoint tensor `name` after transformers' renamings."""
        if not self._renamings and not self._converters:
            return name
        from transformers.core_model_loading import rename_source_key

        renamed, converted = rename_source_key(name, self._renamings, self._converters)
        if converted is not None:
            raise ValueError(f"checkpoint tensor '{name}' needs transformers' weight conversion ({converted!r}: "
                             f"tensors merged or split), which the transformers fallback does not apply; use "
                             f"{WHAT_WORKS}")
        return renamed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names; a base-model checkpoint's names without the prefix
        too) onto the parameters and persistent buffers of the same name."""
        params = dict(self.named_parameters(remove_duplicate=False))
        persistent = set(self.state_dict(keep_vars=True))
        buffers = {n: b for n, b in self.named_buffers() if n in persistent}
        prefix = self.base_model_name + "."
        loaded: set[str] = set()
        for name, tensor in weights:
            renamed = self._rename(name)
            target = next((n for n in (renamed, prefix + renamed) if n in params or n in buffers), None)
            if target is None:
                if _IGNORED.search(name):
                    continue
                raise ValueError(f"checkpoint tensor '{name}' has no matching parameter in {self.hf_class.__name__} "
                                 "(a checkpoint with older tensor names: re-save it with this transformers version)")
            if target == f"{self.head_name}.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the LM head
            dest = params[target] if target in params else buffers[target]
            try:
                default_weight_loader(dest, tensor.to(dest.dtype))
            except ValueError as e:
                raise ValueError(f"'{name}': {e}") from None
            loaded.add(target)
        if self.tie_word_embeddings:
            loaded.add(f"{self.head_name}.weight")
        return loaded
