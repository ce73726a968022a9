# storyjobs: make install | run | test | bench
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install run test bench mutants mutants-all mutants-ci lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# embedded Postgres unless DATABASE_URL; migrate; a dev key; api + 2 workers + sweeper
run: install
	$(BIN)/python -m tools.devrun

# the whole suite on a real Postgres (TEST_DATABASE_URL, else Docker, else
# embedded), in two processes: most of its time is spent waiting on processes.
# worksteal: a process that runs out of tests takes the other's last ones,
# so a few long system tests queued on one side do not end the run alone
test: install
	$(BIN)/python -m pytest -n 2 --dist worksteal

# the named mutants (tests/mutants/catalog.py), each in a scratch copy
# against the tests that should kill it; fails if one survives
mutants: install
	$(BIN)/python -m tests.mutants

# generated mutants (SQL from the parse tree, Python from cosmic-ray's
# operators): a seeded sample stratified by file and operator, each run
# against the tests that execute its code, two at a time; cached in
# .mutants-cache/, reported in tests/mutants/report/. Fails while a sampled
# mutant survives that tests/mutants/equivalent.toml does not list.
MUTANTS_SAMPLE ?= 400
mutants-all: install
	$(BIN)/python -m tests.mutants.generated --sample $(MUTANTS_SAMPLE)

# CI's share of them: a few the report verified, chosen by the commit
# (.ci/run runs them one at a time, beside the named mutants)
MUTANTS_CI_JOBS ?= 2
mutants-ci: install
	$(BIN)/python -m tests.mutants.generated --ci --sample 6 --jobs $(MUTANTS_CI_JOBS)

# the benchmarks, pgqueuer and procrastinate beside storyjobs; results under tests/bench/results/
bench: $(VENV)/.installed-bench
	$(BIN)/python -m tests.bench

# the peers the benchmarks compare storyjobs with: the bench extra, kept out of make install
$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

# what CI checks before the tests: ruff, and mypy --strict on api/ worker/ sweeper/ shared/ tools/ tests/
lint: install
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache
