"""Structured outputs: each constrained request's grammar, its matcher, and the token mask of the step.

The grammar engine is llguidance (docs/engine.md says why): a request's `StructuredOutputsParams` becomes an
llguidance grammar, checked against this engine's tokenizer when the request is submitted (a grammar it cannot
compile is refused, naming the problem) and cached by its text, so the same schema is compiled once. Each
constrained sequence has a matcher fed with its sampled tokens; its state follows the output tokens, which
preemption by recompute and chunked prefill keep, so neither touches it. A step's bitmask is filled on a
helper thread while the forward pass runs (llguidance drops the GIL), then applied to the constrained rows'
logits before sampling. A batch without constraints does nothing here beyond one scan of its params.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from runner_core.errors import InvalidRequestError
from runner_core.sampling_params import StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine (its one tokenizer), least recently used dropped


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer); ValueError when the
    constraint cannot be read."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    matcher = llguidance.LLMatcher
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the schema is not valid JSON: {exc}") from None
        # compact JSON: the model writes no whitespace between tokens (as vLLM's default)
        return matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return matcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:
        return matcher.grammar_from_lark(any_to_lark(so.grammar))
    except Exception as exc:  # the GBNF converter's parse error
        raise ValueError(f"cannot read it as Lark or GBNF: {exc}") from None


class StructuredOutputs:
    """The engine's grammars (compiled once, cached), its sequences' matchers and the step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None
        self._grammars: OrderedDict[str, str] = OrderedDict()  # (kind, spec) as JSON -> a checked grammar
        self._matchers: dict[str, object] = {}  # request id -> its llguidance matcher
        self._pool: ThreadPoolExecutor | None = None
        self.mask_fill_s = 0.0  # seconds the helper thread spent filling masks, summed

    def _llg_tokenizer(self):
        if self._ll_tokenizer is None:
            hf = getattr(self.tokenizer, "hf", None)
            if hf is None:
                raise InvalidRequestError("structured outputs need the model's own tokenizer (tokenizer.json); this "
                                          "model has none (the byte fallback): send the request unconstrained")
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=sorted(self.tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams) -> str:
        """The checked grammar of `so`, from the cache or compiled now; InvalidRequestError naming the problem
        when this engine cannot compile it."""
        value = getattr(so, so.kind)
        key = json.dumps([so.kind, value], sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        import llguidance

        try:
            text = grammar_text(so)
        except ValueError as exc:
            raise InvalidRequestError(f"structured output {so.kind}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self._llg_tokenizer())
        if error:
            problem = " ".join(error.split())  # one line: llguidance's message draws a caret under the fault
            raise InvalidRequestError(f"structured output {so.kind} cannot be compiled: {problem}; fix the "
                                      f"{'schema' if so.kind == 'json' else so.kind} or send the request without it")
        self._grammars[key] = text
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return text

    def add(self, request_id: str, so: StructuredOutputsParams) -> None:
        """Start `request_id`'s matcher (its grammar compiled or cached)."""
        import llguidance

        self._matchers[request_id] = llguidance.LLMatcher(self._llg_tokenizer(), self.compile(so), log_level=0)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    @property
    def has_matchers(self) -> bool:
        return bool(self._matchers)

    def constrained_rows(self, seqs) -> list[int]:
        """The rows of a step's sampled sequences that have a matcher."""
        matchers = self._matchers
        return [i for i, seq in enumerate(seqs) if seq.request_id in matchers] if matchers else []

    def start_fill(self, seqs, rows: list[int]) -> Future:
        """Fill the bitmask [len(rows), words] of these rows on the helper thread (while the forward runs)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        matchers = [self._matchers[seqs[i].request_id] for i in rows]
        return self._pool.submit(self._fill, matchers)

    def _fill(self, matchers: list) -> Tensor:
        import llguidance.torch as llt

        start = time.perf_counter()
        mask = llt.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, matcher in enumerate(matchers):
            llt.fill_next_token_bitmask(matcher, mask, i)
        self.mask_fill_s += time.perf_counter() - start
        return mask

    def apply(self, logits: Tensor, rows: list[int], filled: Future) -> Tensor:
        """`logits` with the tokens each constrained row's grammar forbids set to -inf (a row whose matcher
        allows nothing, one in error, is left as it is: `advance` fails its request)."""
        bits = unpack_bitmask(filled.result(), logits.shape[1]).to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        allowed = bits | ~bits.any(dim=1, keepdim=True)
        return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))

    def advance(self, seqs, sampled: Tensor) -> dict[int, str]:
        """Feed each constrained sequence its sampled token (`sampled` [B]): {row: error} for those whose
        grammar refused it."""
        errors = {}
        for i, (seq, token) in enumerate(zip(seqs, sampled.tolist())):
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None and not matcher.consume_token(token):
                errors[i] = f"structured output: the grammar refused token {token}: {matcher.get_error()}"
        return errors

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def unpack_bitmask(mask: Tensor, vocab_size: int) -> Tensor:
    """[B, words] int32 bitmask -> [B, vocab_size] bool (bit j of word w is token 32 w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    return ((mask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
