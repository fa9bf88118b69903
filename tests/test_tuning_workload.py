"""Workloads: arrival processes' statistics, seeded determinism, lengths, datasets (JSONL and ShareGPT)
read or refused with the file, line and field named, and the JSON round trip sweeps resume from."""

from __future__ import annotations

import json
import math
import random
import re
import statistics

import pytest

from runner_core.tuning import Arrivals, Lengths, Workload, load_dataset


def _gaps(arrivals: Arrivals, n: int = 2000, seed: int = 7) -> list[float]:
    times = arrivals.offsets(n + 1, random.Random(seed))
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_gaps_average_one_over_the_rate():
    rate = 4.0
    gaps = _gaps(Arrivals.poisson(rate))
    # exponential gaps: standard deviation 1/rate, so the mean of n gaps has standard error 1/(rate sqrt(n))
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, abs=4 / (rate * math.sqrt(len(gaps))))
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_spread_of_gaps_not_their_mean(burstiness):
    rate = 2.0
    gaps = _gaps(Arrivals.gamma(rate, burstiness))
    # gamma with shape k and scale 1/(rate k): mean 1/rate, coefficient of variation 1/sqrt(k)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.15)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)


def test_burst_and_concurrency_are_all_due_at_once_and_timed_ones_start_at_zero():
    rng = random.Random(0)
    assert Arrivals.burst().offsets(5, rng) == [0.0] * 5
    assert Arrivals.fixed_concurrency(2).offsets(5, rng) == [0.0] * 5
    times = Arrivals.gamma(10, 0.5).offsets(50, rng)
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0


def test_same_seed_same_requests_and_arrivals_do_not_change_prompts():
    w = Workload(num_requests=20, arrivals=Arrivals.poisson(5), prompt_len=Lengths.uniform(4, 30),
                 output_len=Lengths.uniform(2, 9), seed=3)
    a, b = w.requests(1000), w.requests(1000)
    assert a == b
    assert [r.prompt for r in w.replace(seed=4).requests(1000)] != [r.prompt for r in a]
    other = w.replace(arrivals=Arrivals.gamma(50, 0.3)).requests(1000)
    assert [(r.prompt, r.max_tokens) for r in other] == [(r.prompt, r.max_tokens) for r in a]
    assert [r.arrival_s for r in other] != [r.arrival_s for r in a]


def test_synthetic_requests_follow_lengths_vocab_and_sampling():
    w = Workload(num_requests=200, prompt_len=Lengths.uniform(3, 7), output_len=Lengths.fixed(5), temperature=0.7,
                 top_p=0.9, seed=11)
    reqs = w.requests(50)
    assert [r.index for r in reqs] == list(range(200))
    assert {len(r.prompt) for r in reqs} == {3, 4, 5, 6, 7}
    assert all(3 <= t < 50 for r in reqs for t in r.prompt)
    assert {r.max_tokens for r in reqs} == {5}
    assert reqs[2].sampling == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 13, "ignore_eos": True}
    assert reqs[2].sampling_params().max_tokens == 5


def test_to_dict_round_trips_through_json(tmp_path):
    w = Workload(num_requests=9, arrivals=Arrivals.gamma(3.5, 0.5, concurrency=4), prompt_len=Lengths.fixed(12),
                 dataset=tmp_path / "d.jsonl", temperature=0.5, seed=2)
    assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    with pytest.raises(ValueError, match="unknown keys \\['rate'\\]"):
        Workload.from_dict({**w.to_dict(), "rate": 3})
    with pytest.raises(ValueError, match="bad arrivals .*unexpected keyword argument .speed."):
        Workload.from_dict({**w.to_dict(), "arrivals": {"kind": "burst", "speed": 1}})


def test_labels_name_the_arrivals():
    assert Arrivals.poisson(4).label == "poisson 4/s"
    assert Arrivals.fixed_concurrency(8).label == "concurrency 8"
    assert Workload(num_requests=3, arrivals=Arrivals.burst()).label == "3 req, burst, prompt 16-128, out 16-64"


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Arrivals("steady"), "unknown; use one of burst, poisson"),
    (lambda: Arrivals("poisson"), "needs rate"),
    (lambda: Arrivals("concurrency"), "needs concurrency"),
    (lambda: Arrivals.gamma(2, 0), "burstiness must be > 0"),
    (lambda: Lengths.uniform(9, 3), "need low <= high"),
    (lambda: Lengths.fixed(0), "Lengths.low must be an int >= 1"),
    (lambda: Workload(num_requests=0), "num_requests must be an int >= 1"),
    (lambda: Workload(temperature=-1), "SamplingParams.temperature"),
])
def test_bad_settings_are_refused_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


class _WordTokenizer:
    def encode(self, text, add_special_tokens=True):
        return text.split()


def test_jsonl_dataset_gives_prompts_and_lengths(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 7}\n\n{"prompt": [5, 6, 7], "max_tokens": 3}\n'
                    '{"prompt": "no length"}\n')
    w = Workload(num_requests=3, dataset=str(path), output_len=Lengths.fixed(11))
    reqs = w.requests(vocab_size=100)
    assert [(r.prompt, r.max_tokens) for r in reqs] == [("hello there", 7), ([5, 6, 7], 3), ("no length", 11)]
    assert reqs[1].sampling["max_tokens"] == 3


def test_sharegpt_dataset_takes_the_first_human_turn_and_counts_the_reply(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "why is the sky blue"},
                           {"from": "gpt", "value": "light scatters off small molecules"}]},
        {"conversations": [{"from": "human", "value": "unanswered"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    ]))
    assert len(load_dataset(path)) == 2
    reqs = Workload(num_requests=2, dataset=str(path)).requests(100, tokenizer=_WordTokenizer())
    assert [(r.prompt, r.max_tokens) for r in reqs] == [("why is the sky blue", 5), ("hi", 1)]
    with pytest.raises(ValueError, match="has 2 usable entries, fewer than num_requests=3"):
        Workload(num_requests=3, dataset=str(path)).requests(100)


@pytest.mark.parametrize(("text", "message"), [
    ('{"prompt": "a"}\nnot json\n', "line 2: not JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', "line 2: field 'prompt' must be"),
    ('{"prompt": "a", "output_len": 0}\n', "line 1: field 'output_len' must be an int >= 1"),
    ('[{"conversations": "hi"}]', "entry 0: field 'conversations' must be a list"),
    ('[{"conversations": [{"from": "human"}]}]', "entry 0 turn 0: needs string fields 'from' and 'value'"),
    ('[{"conversations": []', "not valid JSON at line 1"),
])
def test_bad_dataset_files_are_refused_naming_file_line_and_field(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"dataset {re.escape(str(path))}.*{re.escape(message)}"):
        Workload(num_requests=1, dataset=str(path)).requests(100)


def test_a_missing_dataset_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere.jsonl: cannot read it"):
        load_dataset(tmp_path / "nowhere.jsonl")
