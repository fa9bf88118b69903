"""The teaching notebooks execute top to bottom with a real Jupyter kernel (nbclient + ipykernel).

Each notebook may have a check in CHECKS (its file name -> a function of the executed notebook)
asserting what its lesson shows; every notebook must run without an error output, and the saved
copies in the repository carry no outputs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _stream_text(nb) -> str:
    return "\n".join(o.get("text", "") for o in _outputs(nb) if o.output_type == "stream")


def _mime_kinds(nb) -> set[str]:
    return {k for o in _outputs(nb) for k in o.get("data", {})}


def check_quickstart(nb) -> None:
    text = _stream_text(nb)
    assert "refused: SamplingParams.max_tokens got 0" in text
    assert "tokens generated" in text
    peek = re.search(r"peeked while running: (\d+) requests held (\d+) blocks", text)
    assert int(peek.group(1)) >= 4 and int(peek.group(2)) > 0  # the block map was taken while they ran
    kinds = _mime_kinds(nb)
    assert "application/vnd.plotly.v1+json" in kinds  # the charts
    assert "application/vnd.jupyter.widget-view+json" in kinds  # SessionWidgets(session)
    assert "application/vnd.holoviews_exec.v0+json" in kinds  # SessionDashboard(session).inline()


def check_compile_tuning(nb) -> None:
    text = _stream_text(nb)
    assert "greedy tokens equal: True" in text and "recompiles after warm-up: 0" in text
    predicted, measured = re.search(r"predicted ([\d.]+) MiB, measured ([\d.]+) MiB", text).groups()
    # the programs multiply the weights stored once: nothing extra, predicted and measured
    assert predicted == measured == "0.0" and "decode program sizes: [1]" in text
    assert "aoti.pt2" in text and "decode-1.pt2" in text  # the packages in the cache folder


# ---- lessons 03-05 (lessons-a) ----------------------------------------------------------------
def _plotly_figures(nb) -> list[dict]:
    return [o["data"]["application/vnd.plotly.v1+json"] for o in _outputs(nb)
            if "application/vnd.plotly.v1+json" in o.get("data", {})]


def _figure_titled(nb, words: str) -> dict:
    """The first chart whose title contains `words`, asserted to hold data."""
    figs = [f for f in _plotly_figures(nb) if words in f.get("layout", {}).get("title", {}).get("text", "")]
    assert figs, f"no chart titled '{words}'"
    assert any(t.get("y") or t.get("z") for t in figs[0]["data"]), f"the chart '{words}' has no data"
    return figs[0]


def _percent(text: str, label: str) -> float:
    return float(re.search(rf"{label}\s+([\d.]+)%", text).group(1))


def check_paged_kv(nb) -> None:
    text = _stream_text(nb)
    table = re.search(r"A: (\d+) tokens in KV, block table \[([\d, ]+)\]", text)
    tokens, blocks = int(table.group(1)), [int(b) for b in table.group(2).split(",")]
    assert len(blocks) == -(-tokens // 16) and blocks != list(range(blocks[0], blocks[0] + len(blocks)))
    assert "engine slots == block-table formula: True" in text
    paged, static = _percent(text, "paged pool"), _percent(text, "static max_model_len reservation")
    assert paged < 16 < static  # less than a block's tail per request against most of each reservation
    assert _percent(text, "first fit, reserved not filled") > paged
    held = re.search(r"snapshot while running: (\d+) requests hold (\d+) of 64 blocks", text)
    assert int(held.group(1)) >= 6 and int(held.group(2)) > 0
    _figure_titled(nb, "KV slots wasted")
    live = _figure_titled(nb, f"{held.group(1)} requests hold {held.group(2)} of 64 blocks")
    assert any(v >= 2 for row in live["data"][0]["z"] for v in row if v is not None)  # cells owned by requests


def check_continuous_batching(nb) -> None:
    text = _stream_text(nb)
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", text, re.M)
    prefill = [int(r[1]) for r in rows]
    assert prefill[:3] == [32, 32, 32] and prefill[3] < 32  # the 100-token prompt in chunks of the budget
    counts = re.search(r"(\d+) requests: (\d+) admissions = \d+ arrivals \+ (\d+) re-admissions after "
                       r"preemption; (\d+) finished", text)
    requests, admitted, preempted, finished = map(int, counts.groups())
    assert preempted > 0 and admitted == requests + preempted and finished == requests == 8
    assert "their tokens equal the tokens they give alone: True" in text
    fig = _figure_titled(nb, "Continuous batching, step by step")
    traces = {t["name"]: t for t in fig["data"]}
    assert sum(traces["admitted"]["y"]) == admitted and sum(traces["preempted"]["y"]) == preempted
    assert sum(traces["finished"]["y"]) == finished and max(traces["prefill tokens"]["y"]) == 32


def check_memory_prediction(nb) -> None:
    text = _stream_text(nb)
    for part in ("weights", "KV pool", "activation peak"):
        predicted, measured = map(float, re.search(rf"^{part}\s+([\d.]+)\s+([\d.]+)", text, re.M).groups())
        assert measured > 0 and abs(predicted - measured) <= 0.01 * measured, part
    assert "refused: tiny-llama does not fit" in text and "kv_cache_memory=" in text
    # bfloat16 halves the weights and the pool: the advisor's first storage format
    assert re.search(r"dtype='bfloat16' \(weights [\d.]+ MiB stored, needs [\d.]+ MiB: fits", text)
    before, after = map(int, re.search(r"highest occupied block (\d+) -> (\d+)", text).groups())
    assert after < before
    assert re.search(r"shrink: 128 -> 48 blocks, 2.50 MiB released", text)
    assert "same tokens as the undisturbed run: True" in text
    assert "refused: cannot shrink the KV pool to 4 blocks" in text
    _figure_titled(nb, "memory estimate vs measurement")
    _figure_titled(nb, "KV block map")


# ---- lessons 06-08 (parallelism, model adapters, performance) -------------------------------------
def _figures(nb) -> list:
    """The plotly figures a notebook displayed, as figure objects (typed arrays decoded)."""
    import json

    import plotly.io as pio

    return [pio.from_json(json.dumps(f)) for f in _plotly_figures(nb)]


def check_parallelism(nb) -> None:
    text = _stream_text(nb)
    assert "TP=2 greedy tokens equal one process: True" in text
    assert "PP=2 greedy tokens equal one process: True" in text
    assert "2 ranks over gloo" in text
    calls, layers = map(int, re.search(r"all-reduces per step: (\d+) = 2 x (\d+) layers", text).groups())
    assert calls == 2 * layers + 1
    assert re.search(r"send\s+1\.0 calls", text) and re.search(r"recv\s+1\.0 calls", text)  # PP: one hop each way
    # the 70B plan: the chosen layout fits, every layout on fewer devices does not (the rule: fewest devices)
    chosen = re.search(r"as a config: tensor_parallel_size=(\d+), pipeline_parallel_size=(\d+)", text)
    tp, pp = map(int, chosen.groups())
    layouts = {(int(a), int(b)): verdict for a, b, verdict in
               re.findall(r"tp=(\d+) pp=(\d+):\s+[\d.]+ GiB per device, (fits|too big)", text)}
    assert layouts[(tp, pp)] == "fits" and tp * pp > 1
    assert all(v == "too big" for (a, b), v in layouts.items() if a * b < tp * pp)
    comm, plan = _figures(nb)
    assert {t.name for t in comm.data} == {"TP=2", "PP=2"} and max(comm.data[0].y) > 0
    assert len(plan.data[0].y) == len(layouts)


def check_model_adapters(nb) -> None:
    text = _stream_text(nb)
    assert "MixtralForCausalLM: 4 MoE layers x 8 experts, top-2" in text
    picks = re.findall(r"token +\d+ \(id +\d+\): experts (\d), (\d)", text)
    assert picks and all(a != b for a, b in picks)
    assert all(float(x) >= 1.0 for x in re.findall(r"busiest expert e\d took ([\d.]+)x", text))
    heat = _figures(nb)[0].data[0]
    assert heat.type == "heatmap" and len(heat.z) == 4 and len(heat.z[0]) == 8 and sum(map(sum, heat.z)) > 0
    text_len, expanded = map(int, re.search(r"prompt: (\d+) tokens, <image> among them; with the image expanded: "
                                            r"(\d+) tokens", text).groups())
    assert expanded == text_len - 1 + 16  # tiny-llava: one <image> becomes 16 feature rows
    assert "same image again, same tokens: True" in text and "1 hit, 1 miss" in text
    assert "image/png" in _mime_kinds(nb)
    assert "TransformersForCausalLM" in text and "fallback greedy tokens equal native: True" in text
    assert "registered: native" in text and "batched tokens equal one-at-a-time: True" in text


def check_performance(nb) -> None:
    text = _stream_text(nb)
    engines = re.findall(r"^(ours[^\n]*?|transformers[^\n]*?) +[\d.]+ s +([\d.]+) tok/s +MFU +([\d.]+)% +"
                         r"greedy tokens equal ours: (\d+)/(\d+)", text, re.M)
    assert len(engines) == 3
    assert all(float(tps) > 0 and 0 < float(mfu) <= 100 for _, tps, mfu, _, _ in engines)
    assert engines[1][3] == engines[1][4]  # transformers one at a time (unpadded): every request's tokens equal
    assert "vLLM not measured: set COMPARE_VLLM = True" in text  # opt-in: its cold start alone is ~80 s
    throughput_fig, profile_fig = _figures(nb)[:2]
    assert len(throughput_fig.data[0].x) == len(engines) + bool(re.search(r"vLLM: [\d.]+ tok/s", text))
    cases = profile_fig.data[0].y
    assert len(cases) == 3
    for row in range(len(cases)):  # each case's op kinds add up to its whole CPU time
        assert abs(sum(t.x[row] for t in profile_fig.data) - 100) < 1


def check_quantization(nb) -> None:
    text = _stream_text(nb)
    assert "refused: small-llama does not fit" in text
    assert re.search(r"- quantization='int8' \(weights [\d.]+ MiB stored, needs [\d.]+ MiB: fits", text)
    assert "the advisor's choice: int8" in text and re.search(r"\d+ layers stored as int8", text)
    rows = re.findall(r"^(float32|bfloat16|int8|int4 g32|int4 g128) +([\d.]+) +([\d.]+) +([\d.]+)%$", text, re.M)
    assert [r[0] for r in rows] == ["float32", "bfloat16", "int8", "int4 g32", "int4 g128"]
    weights = [float(r[1]) for r in rows]
    assert weights == sorted(weights, reverse=True) and all(float(r[2]) > 0 for r in rows)
    assert float(rows[0][3]) >= 95  # float32's forward against its own greedy tokens
    ppl = dict(re.findall(r"^(float32|int8|int4 g64) +\d+ +[\d.]+ +([+-][\d.]+)%", text, re.M))
    # the quality targets on the trained model (measured: -0.1% and +0.9%)
    assert abs(float(ppl["int8"])) <= 1 and abs(float(ppl["int4 g64"])) <= 5
    bars = _figure_titled(nb, "before and after")
    assert len(bars["data"]) == 2 and all(len(t["x"]) == 2 for t in bars["data"])
    _figure_titled(nb, "before: bfloat16: memory of the model")
    _figure_titled(nb, "after: int8: memory of the model")
    stored = _figure_titled(nb, "Weights stored as int8")["data"][0]
    assert len(stored["y"]) == 2


def check_tuning(nb) -> None:
    text = _stream_text(nb)
    assert "16/16 requests" in text and re.search(r"tpot +p50 +[\d.]+ ms +p90 +[\d.]+ ms +p99 +[\d.]+ ms", text)
    assert "models: ['tiny-llama']" in text and re.search(r"streamed in \d+ chunks, same text: True", text)
    assert "chat refused: 400" in text  # tiny-llama's tokenizer has no chat template
    assert re.search(r"^in process +\d+", text, re.M) and re.search(r"^over HTTP +\d+", text, re.M)
    points, runs, redraws = map(int, re.search(r"(\d+) points, (\d+) measured runs; the chart was redrawn (\d+) "
                                               r"times while the sweep ran", text).groups())
    assert points == 5 and runs == 15 and redraws >= 3  # drawn live: once per measured point at least
    assert "resumed: 15 runs read back, 0 measured; same recommendation: True" in text
    assert "'reload'" not in re.search(r"rebuilt between points: (.*)", text).group(1)
    assert "Recommended: concurrency=" in text
    assert re.search(r"re-run: [\d.]+, [\d.]+, [\d.]+ ms; all under the target: True", text)
    for words in ("Pareto", "Latency against concurrency", "points pass"):
        _figure_titled(nb, words)


def check_whatif(nb) -> None:
    text = _stream_text(nb)
    # the cost model: a decode step of 64 rows reads the weights (memory-bound), a long prefill computes
    assert re.search(r"^linear bound +memory +compute$", text, re.M)
    assert "the parts add up to the total: True" in text
    # this CPU: a fit on measured steps, then one workload real against simulated
    assert int(re.search(r"(\d+) step shapes fitted", text).group(1)) > 0
    for metric in ("TTFT p50 ms", "TPOT p50 ms", "output tok/s"):
        real, simulated = map(float, re.search(rf"^{metric} +([\d.]+) +([\d.]+) +[+-]\d+%$", text, re.M).groups())
        assert real > 0 and simulated > 0, metric
    # the refusals name memory and the layouts that fit; the fitting layout loads
    for device in ("h100-sxm", "l4"):
        assert re.search(rf"refused on one {device}, does not fit: it needs [\d.]+ GiB per device", text)
    assert re.search(r"refused on one h100-sxm, .*Would fit with: .*tensor_parallel_size=\d", text)
    verdicts = dict(re.findall(r"^(\S+(?: \S+)*?) +weights +[\d.]+ GiB, KV pool +[\d.]+ GiB per device of +[\d.]+: "
                               r"(fits|does not fit)$", text, re.M))
    assert verdicts["h100-sxm"] == "does not fit" and verdicts["h100-sxm tp=4"] == "fits"
    assert verdicts["l4 tp=8 int4"] == "fits"
    assert re.search(r"h100-sxm tp=4 loads: weights [\d.]+ GiB per device, KV pool [\d.]+ GiB = \d+ tokens", text)
    _figure_titled(nb, "Memory per device")
    # the sweep: the layout that does not fit is skipped; every point's band is ordered
    assert "skipped {'hardware': 'h100-sxm', 'tensor_parallel_size': 1}" in text
    bands = re.findall(r"^hardware=\S+.*? +([\d.]+) +([\d.]+) +([\d.]+) +[\d.]+ ms (?:meets|misses)", text, re.M)
    assert len(bands) >= 3 and all(float(lo) <= float(mid) <= float(hi) for lo, mid, hi in bands)
    assert "every band ordered low <= typical <= high: True" in text and "recommended: hardware=" in text
    _figure_titled(nb, "What-if: per-user speed against throughput")
    # a published figure against its predicted band
    published, lo, mid, hi, inside = re.search(
        r"published (\d+) output_throughput; predicted (\d+) \(low\) \.\. (\d+) \(typical\) \.\. (\d+) \(high\); "
        r"inside the band: (True|False)", text).groups()
    assert int(lo) <= int(mid) <= int(hi) and (inside == "True") == (int(lo) <= int(published) <= int(hi))
    # the dashboard's What-if tab ran its own simulation
    assert "application/vnd.jupyter.widget-view+json" in _mime_kinds(nb)
    assert re.search(r"What-if tab: done: .* \| [1-9]\d* points, 1 layout skipped", text)


# ---- lesson 12 (parallel sampling, logprobs, structured outputs) --------------------------------------
def check_parallel_logprobs_structured(nb) -> None:
    text = _stream_text(nb)
    # n=4 forks at the prompt's end: the four sequences hold the prompt's 32 blocks, all of them shared
    assert "prompt: 500 tokens = 31 full blocks + 4 tokens" in text
    assert "after the prompt: 4 sequences ['A', 'A#1', 'A#2', 'A#3'], 32 blocks shared by all four, 32 blocks " \
           "in use" in text
    # then the partial 32nd block is copied on first write: three copies, the last holder keeps the original
    after = re.search(r"after \d+ decode steps: (\d+) blocks shared, last blocks (\{.*\}), (\d+) blocks in use", text)
    last = ast.literal_eval(after.group(2))
    assert int(after.group(1)) == 31 and len(set(last.values())) == 4 and 31 in last.values()
    assert int(after.group(3)) == 35
    assert "each completion equals an n=1 request with seed + index: True" in text
    forked, alone, saved = re.search(r"at the most: n=4 (\d+) blocks, four requests (\d+): (\d+) blocks = [\d.]+ MiB "
                                     r"saved", text).groups()
    assert int(forked) == 35 and int(alone) == 4 * 32 and int(saved) == int(alone) - int(forked)
    before = _figure_titled(nb, "KV block map after the prompt: 4 requests hold 32 of 160 blocks, 32 shared")
    assert sum(v == 2 for row in before["data"][0]["z"] for v in row) == 32  # every held cell dark: shared
    _figure_titled(nb, "decode steps: 4 requests hold 35 of 160 blocks, 31 shared")
    # logprobs as a classifier: each candidate scored (sum and mean of its tokens' logprobs), the best chosen
    rows = re.findall(r"^.{36} (.{20}) +(\d+) +(-[\d.]+) +(-[\d.]+)$", text, re.M)
    assert len(rows) == 12 and all(abs(float(s) / int(n) - float(m)) < 0.01 for _, n, s, m in rows)
    assert re.search(r"chosen by sum ' a directory', by mean ' a directory'", text)  # the clear case, by far
    assert re.search(r"sensible answers chosen: by sum \d of 4, by mean \d of 4", text)
    # the JSON answer parses and validates; the mask's cost measured
    assert "finish_reason 'stop'" in text and "valid against the schema: True" in text
    assert re.search(r"^json.loads: \{'name': .*'kind': '(function|class|module)'", text, re.M)
    steps = re.findall(r"median step +([\d.]+) ms over 5 rounds", text)
    assert len(steps) == 2 and all(float(x) > 0 for x in steps)
    assert re.search(r"the mask costs [+-][\d.]+ ms per step at batch 8 \([\d.]+x\)", text)


# ---- lesson 13 (speculative decoding) --------------------------------------------------------------------------
def check_speculative_decoding(nb) -> None:
    text = _stream_text(nb)
    steps = [tuple(map(int, r)) for r in re.findall(r"^ +\d+  .{26} (\d)/(\d) ", text, re.M)]
    assert steps and any(a > 0 for a, _ in steps) and any(d > a for a, d in steps)  # accepted, and rolled back
    assert "rolled back)" in text and "greedy output equal without speculation: True" in text
    gained, taken = map(int, re.search(r"^(\d+) tokens in (\d+) steps", text, re.M).groups())
    assert gained == 24 and taken < gained  # fewer steps than tokens: drafts were accepted
    table = re.findall(r"^ +(\d) +(\d+)% +([\d.]+)  ((?:\d+% ?)+)$", text, re.M)
    assert [int(k) for k, *_ in table] == [1, 2, 4, 8]
    for k, _, length, by_pos in table:
        assert 1 <= float(length) <= int(k) + 1 and len(by_pos.split()) == int(k)
    measured = re.findall(r"^batch +(\d+): +\d+ tokens/s without, +\d+ with k=4: ([\d.]+)x", text, re.M)
    assert [int(b) for b, _ in measured] == [1, 4, 16] and all(float(x) > 0 for _, x in measured)
    predicted = re.findall(r"^ +(\d) +(\d+) +[\d.]+ ms +[\d.]+ ms +[\d.]+ +([\d.]+)x$", text, re.M)
    assert len(predicted) == 12
    for k in ("2", "4", "8"):  # the cost model: the speedup falls as the batch grows
        mine = [float(x) for kk, _, x in predicted if kk == k]
        assert mine == sorted(mine, reverse=True) and mine[0] > 1
    _figure_titled(nb, "Draft, verify, accept, roll back")
    _figure_titled(nb, "Acceptance rate by draft position")
    _figure_titled(nb, "Measured speedup of k=4 prompt lookup")
    _figure_titled(nb, "Predicted speedup, Llama-3.1-8B on an H100")


CHECKS = {
    "01-quickstart.ipynb": check_quickstart,
    "02-compile-tuning.ipynb": check_compile_tuning,
    "03-paged-kv-and-fragmentation.ipynb": check_paged_kv,
    "04-continuous-batching.ipynb": check_continuous_batching,
    "05-memory-prediction.ipynb": check_memory_prediction,
    "06-parallelism.ipynb": check_parallelism,
    "07-model-adapters.ipynb": check_model_adapters,
    "08-performance.ipynb": check_performance,
    "09-quantization.ipynb": check_quantization,
    "10-tuning.ipynb": check_tuning,
    "11-whatif.ipynb": check_whatif,
    "12-parallel-sampling-logprobs-structured.ipynb": check_parallel_logprobs_structured,
    "13-speculative-decoding.ipynb": check_speculative_decoding,
}


def test_every_notebook_has_a_check():
    assert sorted(CHECKS) == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_saved_notebook_has_no_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    assert not [c for c in nb.cells if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tiny_llama_path, monkeypatch):
    """nbclient's run, where the JupyterLab browser test cannot run them (it is required under CI)."""
    import nbformat
    from nbclient import NotebookClient

    from tests.lab_server import missing_tools

    if not missing_tools():
        pytest.skip("run in JupyterLab by tests/test_jupyterlab.py, which applies this check to the saved copy")

    # The kernel inherits the environment (the test preset cache set by conftest) and runs in a
    # folder under test-output, where the notebook's compile cache stays warm between runs.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    workdir = REPO / "test-output" / "notebooks"
    workdir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    client.execute()
    errors = [o for o in _outputs(nb) if o.output_type == "error"]
    assert not errors
    CHECKS[path.name](nb)
