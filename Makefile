# trainbox: `make help` lists the targets. Knobs: GPUS, ARGS, PYTHON, VENV.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Knobs (set on the command line: make train GPUS=2 ARGS="--preset debug"):
#   PYTHON       interpreter that creates the environment (>= 3.10)
#   VENV         the project environment, built from requirements.lock
#   GPUS         workers: empty = every visible GPU (or 1 on CPU), 0 = CPU, N = N workers
#   ARGS         passed to the trainer unchanged (python -m train --help lists every flag)
#   PYTEST_ARGS  extra pytest flags, e.g. PYTEST_ARGS="-k resume -x"
PYTHON ?= python3
VENV ?= .venv
GPUS ?=
ARGS ?=
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help setup train test tensorboard lock clean

help: ## list the targets
	@grep -hE '^[a-z][a-zA-Z_-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'
	@echo "  knobs: GPUS=N (0: CPU)  ARGS=\"--flag value ...\"  PYTEST_ARGS=...  (python -m train --help lists every flag)"

setup: $(STAMP) ## create or update the environment from requirements.lock (hash-checked)

$(STAMP): requirements.lock
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: trainbox needs Python >= 3.10, found " + sys.version.split()[0] + ": set PYTHON=python3.X")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps -r requirements.lock
	@# Put this checkout on the environment's path, so `python -m train` works from any folder.
	@$(PY) -c 'import os, sysconfig; open(os.path.join(sysconfig.get_paths()["purelib"], "trainbox.pth"), "w").write(os.getcwd() + "\n")'
	@touch $@

train: $(STAMP) ## train (default: built-in data, GPU if present, else CPU); GPUS=N, ARGS="..."
	$(PY) -m train.launch --gpus "$(GPUS)" -- $(ARGS)

test: $(STAMP) ## run the test suite (CPU; GPU tests run only where a GPU is visible)
	$(PY) -m pytest $(PYTEST_ARGS)

tensorboard: $(STAMP) ## serve TensorBoard for runs/ on port 6006
	$(VENV)/bin/tensorboard --logdir runs --bind_all --port 6006

lock: ## re-resolve requirements.lock from pyproject.toml (needs uv on PATH)
	uv pip compile --universal --generate-hashes --python-version 3.10 pyproject.toml -o requirements.lock

clean: ## remove the environment and caches (runs/ is kept)
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
