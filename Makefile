# Set-up and entry points. `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?= -n 2
# Stamps inside the venv: the package is installed (editable, so source edits need no reinstall) once
# per venv and again only when pyproject.toml changes.
INSTALLED := $(VENV)/.installed
INSTALLED_TEST := $(VENV)/.installed-test

.PHONY: venv install install-test run test test-all clean

venv: $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# bubblewrap: the sandbox proposed code runs in (specpilot.agent.sandbox); without it, agent.sandbox=none
BWRAP_SUDO := $(shell [ "$$(id -u)" -ne 0 ] && command -v sudo >/dev/null && echo "sudo -n")
define install_bwrap
	@command -v bwrap >/dev/null || $(BWRAP_SUDO) apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
		($(BWRAP_SUDO) apt-get update -q >/dev/null 2>&1 && $(BWRAP_SUDO) apt-get install -y -q bubblewrap >/dev/null 2>&1) || \
		echo "warning: bubblewrap (bwrap) could not be installed: proposed code will be refused unless agent.sandbox=none"
endef

$(INSTALLED): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# The test extras include the package itself, so this stamp satisfies `install` too.
$(INSTALLED_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@ $(INSTALLED)

install: $(INSTALLED)
	$(install_bwrap)

install-test: $(INSTALLED_TEST)
	$(install_bwrap)

run: install
	$(BIN)/python experiments/run.py

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: install-test
	$(BIN)/python -m pytest -q -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
