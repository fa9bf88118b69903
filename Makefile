# One command to set up and run, one to set up and test (see README.md).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= tiny-llama
PROMPT ?= Once upon a time

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[ui,test]" "$(TORCH_SPEC)"
	touch $(STAMP)

run: setup
	$(PY) -m runner_core generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 48

test: setup
	$(PY) -m pytest -q -x

bench: setup
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
