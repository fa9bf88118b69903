"""Two runners stepping on two threads at once give the same tokens as one at a time."""

from __future__ import annotations

import threading

from runner_core import ModelRunner, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_runners_on_two_threads_do_not_interfere(tiny_llama_path):
    runners = [ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
               for _ in range(2)]
    prompts = [[[5, 6, 7] * k for k in range(1, 5)], [[9, 8] * k for k in range(2, 7)]]
    expected = [[o.token_ids for o in r.generate(p, GREEDY)] for r, p in zip(runners, prompts)]
    results, errors = [None, None], []

    def work(i):
        try:
            results[i] = [[o.token_ids for o in runners[i].generate(prompts[i], GREEDY)] for _ in range(3)]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert results == [[expected[0]] * 3, [expected[1]] * 3]
