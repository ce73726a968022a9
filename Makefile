# storyjobs: make install | run | test | bench
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install run test bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# embedded Postgres unless DATABASE_URL; migrate; a dev key; api + 2 workers + sweeper
run: install
	$(BIN)/python -m shared.devrun

# the whole suite on a real Postgres (TEST_DATABASE_URL, else Docker, else embedded)
test: install
	$(BIN)/python -m pytest

# the benchmarks; results under tests/bench/results/
bench: install
	$(BIN)/python -m tests.bench

lint: install
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
