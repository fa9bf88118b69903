"""OutputProcessor: what happens to a sampled token — append it and its time (the request's
RequestMetrics, one clock read per step), record logprobs, detokenize incrementally for streams and stop
strings, apply the stop conditions (stop ids, EOS, stop strings, max_tokens, max_model_len) — and the
RequestOutput handed to callers, which closes a finished request's RequestMetrics. An engine without a
tokenizer (a simulated one whose model is its config alone) has no EOS check by tokenizer and no text:
outputs carry token ids and text "", streams included."""

from __future__ import annotations

from itertools import chain

import torch

from runner_core.engine.clock import WallClock
from runner_core.engine.sequence import CompletionOutput, RequestOutput, Sequence
from runner_core.layers.sampler import token_logprobs


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, clock=None):
        self.tokenizer, self.max_model_len, self.clock = tokenizer, max_model_len, clock or WallClock()
        # a streaming request's prompt ids, copied once for all its outputs (as its logprobs list is shared)
        self._prompt_ids: dict[str, list[int]] = {}

    def append(self, seqs: list[Sequence], sampled) -> list[tuple[Sequence, list[int], str]]:
        """Append one sampled token per sequence, or where `sampled.runs` gives a row's tokens (speculative
        decoding's accepted drafts and the token after them: engine/spec_decode.py), those, in turn, up to a stop
        (the tokens past it are dropped); returns (sequence, new ids, new text) for the sequences that finished or
        stream."""
        updates, runs = [], getattr(sampled, "runs", None)
        now = self.clock.now()
        token_ids = sampled.sampled_token_ids.tolist()
        lp_ids = sampled.logprob_token_ids.tolist() if sampled.logprob_token_ids is not None else None
        lp_vals = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        for i, (seq, tok) in enumerate(zip(seqs, token_ids)):
            prev_len = len(seq.detokenizer.text) if seq.detokenizer is not None else 0
            run = runs[i] if runs is not None else None
            if run is None:
                new, delta = [tok], self._add(seq, tok, now, lp_ids and lp_ids[i], lp_vals and lp_vals[i])
            else:  # no logprobs: a request asking for them gets no drafts
                new, delta = [], ""
                for tok in run:
                    new.append(tok)
                    delta += self._add(seq, tok, now, None, None)
                    if seq.is_finished:
                        break
            if seq.is_finished and seq.detokenizer is not None:
                # final text: cut at a stop string, else the full decode (flushes held-back bytes)
                if seq.text is None:
                    seq.text = self._decode(seq)
                delta = seq.text[prev_len:]
            if seq.is_finished or seq.detokenizer is not None:
                updates.append((seq, new, delta))
        return updates

    def _add(self, seq: Sequence, tok: int, now: float, lp_ids: list[int] | None, lp_vals: list[float] | None) -> str:
        """Append one token (its logprobs, from the sampler's row), check the stop conditions: the new text."""
        seq.token_ids.append(tok)
        seq.metrics.token_times.append(now)  # the step's one clock read, for each of its tokens
        if seq.logprobs is not None:
            k = seq.params.logprobs + 1
            seq.logprobs.append(dict(zip(lp_ids[:k], lp_vals[:k])))
            seq.cumulative_logprob += lp_vals[0]  # the sampled token's
        delta = seq.detokenizer.add([tok]) if seq.detokenizer is not None and self.tokenizer is not None else ""
        self.check_stop(seq, tok, now)
        return delta

    def add_prompt_logprobs(self, spans: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
        """Record prompt logprobs from `logits` [rows, V], the rows of each (sequence, first position, count)
        span in order: position p's logits score prompt token p + 1. One log-softmax and top-k for them all."""
        targets = list(chain.from_iterable(seq.token_ids[p + 1:p + 1 + c] for seq, p, c in spans))
        k = max(seq.params.prompt_logprobs for seq, _, _ in spans)
        ids, values = token_logprobs(logits, torch.tensor(targets, device=logits.device), k)
        ids, values, row = ids.tolist(), values.tolist(), 0
        for seq, _, c in spans:
            n = seq.params.prompt_logprobs + 1
            seq.prompt_logprobs.extend(dict(zip(ids[i][:n], values[i][:n])) for i in range(row, row + c))
            row += c

    def check_stop(self, seq: Sequence, tok: int, now: float) -> None:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                return seq.finish("stop", now, tok)
            if not p.ignore_eos and self.tokenizer is not None and tok in self.tokenizer.eos_token_ids:
                return seq.finish("stop", now)
            if p.stop:
                text = seq.detokenizer.text
                hits = [(text.find(s), s) for s in p.stop if s in text]
                if hits:
                    cut, s = min(hits)
                    seq.text = text[:cut]
                    return seq.finish("stop", now, s)
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length", now)

    def _decode(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def completion(self, seq: Sequence, index: int, delta_ids: list[int], delta_text: str) -> CompletionOutput:
        """`seq`'s CompletionOutput as completion `index` (its final text decoded once it finished)."""
        finished = seq.is_finished
        if finished and seq.text is None:
            seq.text = self._decode(seq)
        return CompletionOutput(
            index=index, text=seq.text if finished else seq.detokenizer.text, token_ids=seq.output_token_ids,
            delta_token_ids=delta_ids, delta_text=delta_text, finished=finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=seq.logprobs,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None)

    def prompt_ids(self, seq: Sequence, finished: bool) -> list[int]:
        """`seq`'s prompt ids, copied once for all of a streaming request's outputs."""
        rid = seq.request_id
        prompt_ids = self._prompt_ids.pop(rid, None) if finished else self._prompt_ids.get(rid)
        if prompt_ids is None:
            prompt_ids = seq.token_ids[:seq.num_prompt_tokens]
            if not finished:
                self._prompt_ids[rid] = prompt_ids
        return prompt_ids

    def output(self, seq: Sequence, delta_ids: list[int], delta_text: str) -> RequestOutput:
        finished = seq.is_finished
        if finished and seq.metrics.finish_reason is None:  # every finished request's output passes here once
            seq.metrics.finish(seq.metrics.finished_time, seq.finish_reason, seq.error)
        return RequestOutput.of(seq.request_id, seq.prompt, self.prompt_ids(seq, finished),
                                [self.completion(seq, 0, delta_ids, delta_text)], finished, seq.error,
                                seq.metrics.as_dict(seq.num_cached_tokens), seq.prompt_logprobs)
