# The two commands: `make run` (main job) and `make test` (whole suite). Both set up .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint verify bench certificate study clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[triton,dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/opforge demo --out reports

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -n 2 -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

verify: $(STAMP)
	$(BIN)/opforge verify --report reports/verify

study: $(STAMP)
	$(BIN)/opforge demo --study --out reports --doc docs/precision-study.md

certificate: $(STAMP)
	$(BIN)/opforge verify --report reports/verify --certificate docs/precision-certificate.md

bench: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python benchmarks/replay.py

clean:
	rm -rf $(VENV) reports .pytest_cache
