# Set-up and entry points. `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?= -n 2

.PHONY: venv install install-test run test test-all clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"

run: install
	$(BIN)/python experiments/run.py

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: install-test
	$(BIN)/python -m pytest -q -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
