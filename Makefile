# Quick start: `make demo` and `make test` each build .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench bench-quick clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,lint]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python examples/demo.py --root "$(CURDIR)/demo-journal"

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/mypy --strict tests/typing/user_code.py

test: $(BIN)/.installed lint
	$(BIN)/python -m pytest --cov=itemjournal --cov-report=term-missing --cov-fail-under=95 tests

bench: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

bench-quick: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench.py --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .coverage .mypy_cache .ruff_cache
