# Quick start: `make demo` and `make test` each build their environment when it is missing:
# the demo's (.venv-demo) holds the package and the extra it uses, the suite's (.venv) the
# test and lint tools too.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_VENV := .venv-demo
DEMO_BIN  := $(DEMO_VENV)/bin
# make test-dist: a fresh environment outside the source tree, made anew each run.
DIST_VENV ?= $${TMPDIR:-/tmp}/itemjournal-test-dist
# Workers for the installed suite (pytest-xdist); 0 runs it in one process.
DIST_WORKERS ?= 2
# More pytest arguments for the installed suite (`-m "not slow"`, `-k packaging`).
DIST_PYTEST_ARGS ?=
# Which tests the installed wheel runs (paths under the repository): all of them unless
# told otherwise.
DIST_TESTS ?= tests

.PHONY: demo test lint dist test-dist docs bench bench-quick bench-instructions bench-profile bench-peers clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,lint]'
	touch $@

$(DEMO_BIN)/.installed: pyproject.toml
	test -x $(DEMO_BIN)/python || $(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/python -m pip install --quiet --upgrade pip
	$(DEMO_BIN)/python -m pip install --quiet -e '.[cli]'
	touch $@

demo: $(DEMO_BIN)/.installed
	$(DEMO_BIN)/python examples/demo.py --root "$(CURDIR)/demo-journal"

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks examples docs/_ext tools
	$(BIN)/ruff format --check src tests benchmarks examples docs/_ext tools
	$(BIN)/mypy
	$(BIN)/mypy --strict tests/typing/user_code.py
	$(BIN)/pyright tests/typing/user_code.py
	$(BIN)/mypy --strict tests/typing/narrowing.py
	$(BIN)/pyright tests/typing/narrowing.py
	$(BIN)/python tools/check_layout.py
	$(BIN)/python tools/async_to_sync.py --check

# Workers for `make test` (pytest-xdist; 0 runs the suite in one process).
TEST_WORKERS ?= 2
# The PostgreSQL server the suite tests the PostgreSQL store on: the local one unless the
# environment names another; set it empty to skip those tests (the coverage gate then fails,
# since the store goes untested).
export ITEMJOURNAL_TEST_POSTGRES ?= postgresql://postgres@127.0.0.1:5432/test

# The coverage gate: what the suite measures in its own processes. Code exercised only in
# the subprocesses the suite starts (the viewer's server under a slowloris, the MCP
# example over stdio, the broker workers) is tested there but not counted here.
test: $(BIN)/.installed lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --cov=itemjournal --cov-report=term-missing \
		--cov-fail-under=94 tests

# The sdist and the wheel in dist/, then the packaging tests on exactly those files.
dist: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[dist]'
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	ITEMJOURNAL_TEST_DIST="$(CURDIR)/dist" $(BIN)/python -m pytest -q tests/test_packaging.py

# The whole suite against the installed wheel: a fresh environment outside the tree, the
# wheel and its test extra installed there, pytest started from that environment's folder.
# ITEMJOURNAL_TEST_INSTALLED=1 makes the suite refuse to start unless it imports the
# installed copy (tests/conftest.py); no coverage here, `make test` measures it.
test-dist: dist
	rm -rf "$(DIST_VENV)"
	$(PYTHON) -m venv "$(DIST_VENV)"
	"$(DIST_VENV)/bin/python" -m pip install --quiet --upgrade pip
	"$(DIST_VENV)/bin/python" -m pip install --quiet "$$(ls "$(CURDIR)"/dist/itemjournal-*.whl)[test]"
	cd "$(DIST_VENV)" && ITEMJOURNAL_TEST_INSTALLED=1 ITEMJOURNAL_TEST_DIST="$(CURDIR)/dist" \
		./bin/python -m pytest -c "$(CURDIR)/pyproject.toml" --rootdir "$(CURDIR)" \
		-n $(DIST_WORKERS) $(DIST_PYTEST_ARGS) $(addprefix "$(CURDIR)"/,$(DIST_TESTS))

# The documentation site in site/ (mkdocs, strict: any warning fails the build).
docs: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

bench-quick: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench.py --quick $(BENCH_ARGS)

# How it compares: the peers (DBOS, Powertools' idempotency on Redis, the idempotency
# package) next to itemjournal, throughput and crash tables (BENCH_ARGS='--quick').
bench-peers: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[peers]'
	$(BIN)/python benchmarks/peers/bench_peers.py $(BENCH_ARGS)

# Instructions per begin + complete on MemoryStore, and the floor beside them, counted by
# valgrind's callgrind (Debian: valgrind): repeatable whatever else the machine is doing.
bench-instructions: $(BIN)/.installed
	$(BIN)/python benchmarks/instructions.py $(BENCH_ARGS)

# Where a store's CPU goes: a py-spy profile of every thread over begin + complete cycles
# (BENCH_ARGS='--store memory|file|sqlite --concurrency 16 --cycles 20000'), or with
# BENCH_ARGS='--cpu' each thread's CPU per cycle.
bench-profile: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/profile.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_VENV) .coverage .mypy_cache .ruff_cache dist site
