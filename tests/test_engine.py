"""Continuous batching behaviour: the same tokens whatever the batching, preemption or chunking;
streaming, stop conditions, seeded sampling and the Appendix B tensor form."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import runner_core
from runner_core import ModelRunner, RequestMetrics, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner({"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 22, **kw}).load_model()


def _prompts(n=6, seed=3, vocab=512):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    prompts = _prompts()
    return prompts, [runner.generate(p, GREEDY)[0].token_ids for p in prompts]


def test_batched_equals_one_at_a_time(tiny_llama_path, reference):
    prompts, expected = reference
    outs = _runner(tiny_llama_path).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


def test_preemption_by_recompute_keeps_tokens(tiny_llama_path, reference):
    prompts, expected = reference
    # 8 blocks x 16 = 128 tokens: enough for one sequence at max_model_len, far from all six
    bytes_per_block = 16 * 4 * 2 * 2 * 32 * 4
    runner = _runner(tiny_llama_path, kv_cache_memory=8 * bytes_per_block, max_model_len=128)
    outs = runner.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert runner.memory_stats()["blocks_free"] == 8


def test_chunked_prefill_keeps_tokens(tiny_llama_path, reference):
    prompts, expected = reference
    runner = _runner(tiny_llama_path, max_num_batched_tokens=8, max_num_seqs=4)
    outs = runner.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    steps = list(runner.step_metrics)
    assert max(m.num_prefill_tokens + m.num_decode_tokens for m in steps) <= 8
    assert max(m.num_seqs for m in steps) <= 4


def test_requests_join_a_running_batch(tiny_llama_path, reference):
    prompts, expected = reference
    runner = _runner(tiny_llama_path)
    first = runner.add_request(prompts[0], GREEDY)
    for _ in range(5):
        runner.step()
    later = [runner.add_request(p, GREEDY) for p in prompts[1:]]
    done = {}
    while runner.has_unfinished_requests():
        for out in runner.step():
            done[out.request_id] = out.token_ids
    assert [done[r] for r in [first, *later]] == expected
    mixed = [m for m in runner.step_metrics if m.num_prefill_tokens and m.num_decode_tokens]
    assert mixed, "a step should have mixed the running decode with new prefills"


def test_stream_deltas_add_up(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    deltas = list(runner.stream("Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    final = runner.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert "".join(d.text for d in deltas) == final.text == deltas[-1].output.text
    assert final.text == runner.tokenizer.decode(final.token_ids)


def test_abandoned_stream_frees_its_blocks(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    stream = runner.stream("Hello there", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    stream.close()
    assert not runner.has_unfinished_requests()
    assert runner.memory_stats()["blocks_used"] == 0


def test_stop_conditions(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    base = runner.generate("The cat", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    tokens = base.token_ids
    # a stop token id: output ends with it
    stop_tok = tokens[5]
    out = runner.generate("The cat", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == tokens[: tokens.index(stop_tok) + 1]
    # a stop string: text is cut before it
    stop_str = base.text[8:11]
    assert stop_str
    out = runner.generate("The cat", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=stop_str))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == base.text[: base.text.index(stop_str)]
    # EOS: treat a token the model emits as EOS by making it the only stop... via min_tokens
    out = runner.generate("The cat", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[tokens[0]], min_tokens=3))[0]
    assert len(out.token_ids) >= 3
    # max_model_len ends a generation with "length"
    short = _runner(tiny_llama_path, max_model_len=20)
    out = short.generate([5] * 15, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_eos_stops_unless_ignored(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    base = runner.generate("The dog", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    eos = base.token_ids[6]
    runner.tokenizer.eos_token_ids = frozenset({eos})  # the engine reads EOS ids from the tokenizer
    out = runner.generate("The dog", SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == base.token_ids[: base.token_ids.index(eos) + 1]
    ignored = runner.generate("The dog", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = runner.generate("a seeded prompt", params)[0].token_ids
    noise = SamplingParams(max_tokens=30, temperature=1.0)
    batch = runner.generate(["other", "a seeded prompt", "more noise here"], [noise, params, noise])
    assert batch[1].token_ids == alone
    other_seed = runner.generate("a seeded prompt", params.replace(seed=99))[0].token_ids
    assert other_seed != alone


def test_logprobs(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    out = runner.generate([7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == pytest.approx(max(lp.values()))


def test_appendix_b_tensor_form(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    input_ids = torch.tensor([[1, 2, 3, 4, 5], [1, 9, 8, 7, 6]])
    res = runner.generate(input_ids, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert res["sequences"].shape == (2, 15)
    assert res["sequences"][:, :5].tolist() == input_ids.tolist()
    assert res["sequences"][0, 5:].tolist() == res["outputs"][0].token_ids
    assert runner.forward(input_ids)["logits"].shape == (2, 5, runner.engine.vocab_size)


def test_output_metrics(tiny_llama_path):
    out = _runner(tiny_llama_path).generate("metrics", GREEDY)[0]
    assert out.metrics["time_to_first_token_s"] > 0
    assert out.metrics["tokens_per_s"] > 0


def test_the_engine_fills_the_callers_request_metrics(tiny_llama_path):
    """One timing record per request from the engine out: the caller's arrival kept, one time per token
    (its step's), the end and its reason; the outputs' `metrics` dicts are derived from it."""
    runner = _runner(tiny_llama_path)
    done, aborted = RequestMetrics(runner.engine.clock.now()), RequestMetrics(runner.engine.clock.now())
    runner.add_request([5, 6, 7, 8], GREEDY.replace(max_tokens=6), stream=True, metrics=done)
    other = runner.add_request([9, 10], GREEDY.replace(max_tokens=50), stream=True, metrics=aborted)
    outs = []
    while runner.has_unfinished_requests():
        outs += runner.step()
        if len(aborted.token_times) == 3 and aborted.finished_time is None:
            outs.append(runner.abort_request(other))
    assert (done.num_prompt_tokens, done.num_output_tokens, aborted.num_prompt_tokens) == (4, 6, 2)
    assert done.arrival_time <= done.first_scheduled_time <= done.token_times[0]
    assert done.token_times == sorted(set(done.token_times))  # one step, one time, per token
    assert done.token_times[:3] == aborted.token_times  # the two ran in the same steps
    assert done.token_times[-1] == done.finished_time and (done.finish_reason, done.error, done.ok) == (
        "length", None, True)
    assert aborted.finish_reason == "abort" and not aborted.ok and aborted.finished_time >= aborted.token_times[-1]
    last = [o for o in outs if o.finished and o.finish_reason == "length"][-1]
    assert last.metrics == done.as_dict() and last.metrics["latency_s"] == done.e2e
    assert last.metrics["tokens_per_s"] == pytest.approx(5 / (done.token_times[-1] - done.token_times[0]))


@pytest.mark.parametrize(("reason", "error", "expected"), [
    ("stop", None, None), ("length", None, None), ("error", "the engine failed", "the engine failed"),
    ("error", None, "request ended with finish_reason 'error'"),
    ("abort", None, "request ended with finish_reason 'abort'"),
])
def test_finish_makes_an_error_of_an_abort_or_a_failure(reason, error, expected):
    record = RequestMetrics(0.0, token_times=[0.1, 0.2])
    record.finish(0.3, reason, error)
    assert (record.finished_time, record.finish_reason, record.error, record.ok) == (0.3, reason, expected,
                                                                                     expected is None)


def test_an_outputs_metrics_dict_is_derived_from_the_record():
    record = RequestMetrics(0.0, token_times=[0.1, 0.3, 0.5], num_preemptions=2)
    assert record.as_dict()["tokens_per_s"] is None  # the decode rate is given once finished
    record.finish(0.5, "length")
    assert record.as_dict(num_cached_tokens=16) == pytest.approx({
        "time_to_first_token_s": 0.1, "tokens_per_s": 1 / record.tpot, "latency_s": 0.5, "num_preemptions": 2,
        "num_cached_prompt_tokens": 16})



def test_step_inputs_live_in_reused_buffers(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    fp = runner.engine.worker.forward_pass
    seen = []
    original = fp.execute

    def spy(inp):
        seen.append((inp.input_ids.data_ptr(), inp.positions.data_ptr(), inp.meta.slot_mapping.data_ptr()))
        return original(inp)

    fp.execute = spy
    runner.generate(["one prompt", "and another one"], SamplingParams(max_tokens=5, temperature=0.0))
    bufs = fp.buffers.cpu
    expected = (bufs["input_ids"].data_ptr(), bufs["positions"].data_ptr(), bufs["slot_mapping"].data_ptr())
    assert len(seen) >= 5 and all(s == expected for s in seen)


def test_model_info_says_what_was_loaded_and_how(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    info = runner.model_info()
    assert (info["architecture"], info["model_impl"], info["kind"], info["model_class"]) == (
        "LlamaForCausalLM", "native", "causal_lm", "LlamaForCausalLM")
    assert info["reason"] == "auto: a native adapter is registered" and info["dtype"] == "float32"
    # every checkpoint tensor, those the layers store as panels included
    assert info["num_parameters"] == sum(t.numel() for t in load_file(tiny_llama_path / "model.safetensors").values())
    assert runner_core.supported_architectures().items() >= {
        "LlamaForCausalLM": "native", "MistralForCausalLM": "native", "Qwen2ForCausalLM": "native",
        "Qwen3ForCausalLM": "native"}.items()
