# trainbox: `make help` lists the targets. Shell stays thin: every decision lives in train/ (Python).
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Knobs, on the command line (make train GPUS=2 ARGS="--preset debug"), each with its comment above it.
# Workers: empty = every visible GPU (or 1 on CPU), 0 = CPU, N = N workers
GPUS ?=
# Passed to the trainer unchanged (python -m train --help lists every flag)
ARGS ?=
# torchrun restarts of a multi-worker run after a worker crashes (empty: 3, train/cluster/jobs.py); it resumes
MAX_RESTARTS ?=
# The interpreter that creates the local environment (>= 3.10)
PYTHON ?= python3
# The local environment, built from requirements.lock
VENV ?= .venv
# A docker client that builds with BuildKit: `docker` when it has buildx, else Debian's /usr/bin/docker
DOCKER ?= $(shell docker buildx version >/dev/null 2>&1 || ! test -x /usr/bin/docker \
  && echo docker || echo /usr/bin/docker)
# "docker compose" (v2) or docker-compose (v1.29): whichever is installed
COMPOSE ?= $(shell $(DOCKER) compose version >/dev/null 2>&1 && echo "$(DOCKER) compose" || echo docker-compose)
# docker | local: where `make train` runs; default: docker when an engine answers, else local
RUNTIME ?= $(shell $(DOCKER) info >/dev/null 2>&1 && echo docker || echo local)
# The image tag to build and run
IMAGE ?= trainbox:local
# torch's CUDA build: cu130 (PyPI; driver >= 580), or cu128 / cu126 for 535/550/570 drivers (`make lock` first)
TORCH_FLAVOUR ?= cu130
# The CUDA base image: the one matching TORCH_FLAVOUR (pin it by digest: see docker/Dockerfile)
BASE_IMAGE ?= $(BASE_$(TORCH_FLAVOUR))
# A CA bundle for builds behind a TLS-intercepting proxy (a BuildKit secret, never stored in the image)
EXTRA_CA ?=
# Extra `docker build` flags, e.g. --no-cache or --progress=plain
BUILD_FLAGS ?=
# The container user: yours (root's too); the image's own default user and the services' are never root (1000 for root)
HOST_UID ?= $(word 1,$(shell python3 -m train.hostenv --ids))
HOST_GID ?= $(word 2,$(shell python3 -m train.hostenv --ids))
# The datasets' folder: --data-dir of `make train` (not beside a --data-dir in ARGS; in the container: mounted
# read-only by `make env`, where a --data-dir in ARGS may name a folder under it);
# `make evaluate`: another dataset to score on
DATA_DIR ?=
# NAS folder for `make env` (runs and checkpoints, read-write)
RUNS_DIR ?=
# The compose settings file that `make env` writes and compose reads
ENV_FILE ?= .env
# Extra pytest flags, e.g. PYTEST_ARGS="-k resume -x"
PYTEST_ARGS ?=
# make test's pytest-xdist workers: the tests that wait on an engine run beside those that compute (0: one process)
TEST_WORKERS ?= 3
# Flags for `make bench`, e.g. BENCH_ARGS="--rounds 5 --out runs/bench-a"
BENCH_ARGS ?=
# Flags for `make chaos`, e.g. CHAOS_ARGS="--trials 5 --launchers torchrun,make --faults kill"
CHAOS_ARGS ?=
# `make pack`: the dataset to pack (an ImageFolder, label files, another tool's WebDataset tars or a Hugging Face
# dataset saved to disk), and the folder for its shards
SRC ?=
DST ?=
# ... the processes that read and resize the images (empty: every usable core)
WORKERS ?=
# ... the longer side in pixels above which an image is resized to it and re-encoded (empty: keep every image)
MAX_SIDE ?=
# ... and the JPEG quality of those it re-encodes (empty: 90)
QUALITY ?=
# ... more flags of python -m train.pack, e.g. PACK_ARGS="--label-column y" (label files' columns, tars' --label-key,
# a Hugging Face dataset's --image-column, --label-column, --train-split, --val-split)
PACK_ARGS ?=
# `make evaluate`, `make export`: the run's folder
RUN ?=
# ... and which of its checkpoints: model (model.pt), best (best.pt), ema (model_ema.pt), best_ema or a file
CHECKPOINT ?= model
# ... and, for a run of your own package.module:factory model, that factory (a run folder alone never runs code)
MODEL ?=
# ... and, for a run of your own package.module:factory task (docs/tasks.md), that factory
TASK ?=
# `make export`: pt2 (torch.export, for a process with torch) or onnx (ONNX Runtime, TensorRT, ...; adds ONNX_VENV)
FORMAT ?= pt2
# The output of `make enroot` / `make apptainer` (put them on the NAS for Slurm jobs)
SQSH ?= trainbox.sqsh
SIF ?= trainbox.sif
# The ports `make tensorboard` and `make mlflow` serve on (on 127.0.0.1)
TENSORBOARD_PORT ?= 6006
MLFLOW_PORT ?= 5000
# MLFLOW_EXPOSE=1: a team server, on MLFLOW_BIND (then 0.0.0.0), with a login for every request
MLFLOW_EXPOSE ?=
MLFLOW_BIND ?= $(if $(filter 1,$(MLFLOW_EXPOSE)),0.0.0.0,127.0.0.1)
# MLFLOW_AUTH=1: the same login on 127.0.0.1, which every local user of this machine reaches
MLFLOW_AUTH ?=
# The admin's password for MLFLOW_EXPOSE=1 or MLFLOW_AUTH=1: a file only you can read
MLFLOW_ADMIN_PASSWORD_FILE ?=
# `make mlflow-user`: the training jobs' MLflow user (not an admin), and its password's file (empty: ~/.mlflow-USER)
MLFLOW_USER ?= trainer
MLFLOW_USER_PASSWORD_FILE ?=
# The MLflow server's image and its base
MLFLOW_IMAGE ?= trainbox-mlflow:local
MLFLOW_BASE_IMAGE ?= python:3.12-slim
# The MLflow server's local environment (`make mlflow RUNTIME=local`), from docker/mlflow.lock
MLFLOW_VENV ?= .venv-mlflow
# SkyPilot's environment (`make sky-setup`), from tests/skypilot.lock
SKY_VENV ?= .venv-sky
# ONNX export's environment (`make onnx-setup`, on the first FORMAT=onnx): .venv's packages plus docker/onnx.lock
ONNX_VENV ?= .venv-onnx
# webdataset's environment (`make wds-setup`), from tests/webdataset.lock: the tests write tars with its ShardWriter
WDS_VENV ?= .venv-wds
# Hugging Face datasets' environment (`make hf-setup`), from tests/hf.lock: the tests write datasets with it
HF_VENV ?= .venv-hf
# (MLFLOW_TRACKING_URI: an MLflow server to track runs in, from the environment; `make env` writes it for compose)

PY := $(VENV)/bin/python
# pip installs from a lock file: every hash checked, nothing else pulled in; the bytecode after it, on every core
# (pip compiles on one core). Like pip, it leaves a file this Python cannot compile to its source (torch ships one
# in 3.12 syntax).
PIP_LOCKED := --quiet --disable-pip-version-check --require-hashes --no-deps --no-compile
BYTECODE := import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0)
# trainbox's own modules too (as the image has them): without their bytecode a process under PYTHONDONTWRITEBYTECODE
# compiles them at each start (0.1 CPU s of every trainer process); make test refreshes what was edited since. Never
# a failure: a checkout it cannot write to runs as before, a module that does not compile fails where it is imported
OWN_BYTECODE := $(PY) -m compileall -qq -j 0 train || true
# `make setup`: Python >= 3.10; then the project installed in .venv as an editable package (`python -m train` from
# any folder), with the locked setuptools and nothing fetched; the path file of older setups removed
NEEDS_310 := import sys; v = sys.version.split()[0]; ok = sys.version_info >= (3, 10)
NEEDS_310 += ; sys.exit(0 if ok else "error: trainbox needs Python >= 3.10, found " + v + ": set PYTHON=python3.X")
OLD_PATH_FILE := import os, sysconfig; p = os.path.join(sysconfig.get_paths()["purelib"], "trainbox.pth")
OLD_PATH_FILE += ; os.path.exists(p) and os.remove(p)
PIP_EDITABLE := --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-index -e .
# ONNX_VENV sees every package of .venv (torch, trainbox) after its own: a path file that adds .venv's site-packages
# as a site directory. .venv itself never changes, and docker/onnx.lock pins what both hold to requirements.lock's.
SEES_VENV := import sys, sysconfig, pathlib; own = sysconfig.get_paths()["purelib"]
SEES_VENV += ; there = sysconfig.get_paths(vars={"base": sys.argv[1], "platbase": sys.argv[1]})["purelib"]
SEES_VENV += ; pathlib.Path(there, "trainbox-venv.pth").write_text(f"import site; site.addsitedir({own!r})\n")
# WEIGHTS= (the old name of CHECKPOINT=) given to evaluate or export: one line naming the new, exit 2.
renamed_weights = $(if $(filter command line environment,$(origin WEIGHTS)),echo "error: WEIGHTS=$(WEIGHTS) is now \
  CHECKPOINT=$(WEIGHTS): make $(1) RUN=$(RUN) CHECKPOINT=$(WEIGHTS)" >&2; exit 2,true)
# The MLflow server's knobs, for its recipes only (exported, they would reach every recipe, `make test` too).
MLFLOW_KNOBS = MLFLOW_EXPOSE="$(MLFLOW_EXPOSE)" MLFLOW_BIND="$(MLFLOW_BIND)" MLFLOW_AUTH="$(MLFLOW_AUTH)" \
  MLFLOW_ADMIN_PASSWORD_FILE="$(MLFLOW_ADMIN_PASSWORD_FILE)"
# `make pack`'s knobs as its flags, each where it is set.
PACK_FLAGS = $(if $(WORKERS),--workers "$(WORKERS)") $(if $(MAX_SIDE),--max-side "$(MAX_SIDE)")
PACK_FLAGS += $(if $(QUALITY),--quality "$(QUALITY)")
# Before a build: its base image in the engine (pulled now), or one line naming it and the choices.
FETCH_BASE = $(PYTHON) -m train.hostenv --docker "$(DOCKER)" --fetch-base
# Each torch flavour: its lock file and a CUDA base image of the same CUDA version.
BASE_cu130 := nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
BASE_cu128 := nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
BASE_cu126 := nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
CUDA_cu130 := 13.0
CUDA_cu128 := 12.8
CUDA_cu126 := 12.6
LOCK := $(if $(filter cu130,$(TORCH_FLAVOUR)),requirements.lock,docker/locks/$(TORCH_FLAVOUR).lock)
# cu130 resolves for every platform and Python >= 3.10; the others for the image (Linux x86-64, Python 3.12).
LOCK_FLAGS_cu130 := --universal --python-version 3.10
LOCK_FLAGS_OTHER := --index https://download.pytorch.org/whl/$(TORCH_FLAVOUR) --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28
LOCK_FLAGS := $(if $(filter cu130,$(TORCH_FLAVOUR)),$(LOCK_FLAGS_cu130),$(LOCK_FLAGS_OTHER))
COMPOSE_RUN := $(COMPOSE) --env-file $(ENV_FILE)
STAMP := $(VENV)/.installed-$(TORCH_FLAVOUR)
# FORMAT=onnx exports in ONNX_VENV (installed on first use), any other FORMAT in .venv (train.export checks it)
EXPORT_VENV := $(if $(filter onnx,$(FORMAT)),$(ONNX_VENV),$(VENV))
EXPORT_NEEDS := $(STAMP) $(if $(filter onnx,$(FORMAT)),$(ONNX_VENV)/.installed)
# Compose reads HOST_UID, DATA_DIR, ... from $(ENV_FILE); these come from make's knobs.
export GPUS MAX_RESTARTS MLFLOW_PORT
export TRAINBOX_IMAGE := $(IMAGE)

.PHONY: help setup train train-local train-docker test check bench pack evaluate export onnx-setup chaos build image \
  shell tensorboard mlflow mlflow-user mlflow-setup mlflow-image sky-setup wds-setup hf-setup env doctor enroot \
  apptainer lock clean

help: ## list the targets
	@grep -hE '^[a-z][a-zA-Z_-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'
	@echo "  knobs: GPUS=N (0: CPU)  ARGS=\"...\"  RUNTIME=docker|local  BASE_IMAGE=...  (see the top of the Makefile)"

setup: $(STAMP) ## create or update the local environment from requirements.lock (hash-checked)

$(STAMP): $(LOCK) pyproject.toml
	@$(PYTHON) -c '$(NEEDS_310)'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_LOCKED) -r $(LOCK)
	@$(PY) -c '$(BYTECODE)'
	@$(PY) -c '$(OLD_PATH_FILE)'
	$(PY) -m pip install $(PIP_EDITABLE)
	@$(OWN_BYTECODE)
	@touch $@

train: train-$(RUNTIME) ## train: in the container if a Docker engine answers, else locally; GPUS=N, ARGS="..."

train-local: $(STAMP) ## train in the local environment (what RUNTIME=local selects)
	@echo "trainbox: local environment ($(VENV)); RUNTIME=docker for the container" >&2
	@$(if $(and $(DATA_DIR),$(findstring --data-dir,$(ARGS))),echo "error: DATA_DIR=$(DATA_DIR) and --data-dir in \
	  ARGS both name the data: give one" >&2; exit 2)
	@$(PY) -m train.launch --gpus "$(GPUS)" --max-restarts "$(MAX_RESTARTS)" -- \
	  $(if $(DATA_DIR),--data-dir "$(DATA_DIR)") $(ARGS)

train-docker: image $(ENV_FILE) ## train in the container via compose (what RUNTIME=docker selects)
	@echo "trainbox: container $(IMAGE) via $(COMPOSE); RUNTIME=local for the local environment" >&2
	@$(PYTHON) -m train.hostenv --check-writable --file $(ENV_FILE) -- $(ARGS)
	TRAINBOX_IMAGE_DIGEST=$$($(DOCKER) image inspect --format '{{.Id}}' $(IMAGE)) $(COMPOSE_RUN) run --rm trainer $(ARGS)

test: $(STAMP) ## run the test suite (GPU tests run only where a GPU is visible)
	@$(OWN_BYTECODE)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

check: $(STAMP) ## the edit-test loop (minutes): the unit tests and one short run through each launcher
	@$(OWN_BYTECODE)
	$(PY) -m pytest -m "not slow or check" $(PYTEST_ARGS)

bench: $(STAMP) ## benchmark: trainbox vs a bare DDP loop, scaling, comm, input, checkpoints (BENCH_ARGS=...)
	$(PY) -m train.bench $(BENCH_ARGS)

pack: $(STAMP) ## an ImageFolder, label files, tars or an HF dataset as tar shards: SRC= DST= [WORKERS= MAX_SIDE=]
	@test -n "$(SRC)" -a -n "$(DST)" || { echo "error: give both folders: make pack SRC=/nas/datasets/mydata" \
	  "DST=/nas/datasets/mydata-shards" >&2; exit 2; }
	$(PY) -m train.pack "$(SRC)" "$(DST)" $(PACK_FLAGS) $(PACK_ARGS)

evaluate: $(STAMP) ## score a run's model: RUN=runs/<name> [CHECKPOINT=best] [DATA_DIR=another set] [GPUS=N workers]
	@$(call renamed_weights,evaluate)
	@test -n "$(RUN)" || { echo "error: name the run: make evaluate RUN=runs/<name> (CHECKPOINT=best for best.pt)" \
	  >&2; exit 2; }
	$(PY) -m train.evaluate "$(RUN)" --checkpoint "$(CHECKPOINT)" $(if $(DATA_DIR),--data-dir "$(DATA_DIR)") \
	  --gpus "$(GPUS)" $(if $(MODEL),--model "$(MODEL)") $(if $(TASK),--task "$(TASK)")

export: $(EXPORT_NEEDS) ## ship a run's model: RUN=runs/<name> [CHECKPOINT=best] [FORMAT=onnx] -> RUN/model.pt2 or .onnx
	@$(call renamed_weights,export)
	@test -n "$(RUN)" || { echo "error: name the run: make export RUN=runs/<name> (CHECKPOINT=best for best.pt)" \
	  >&2; exit 2; }
	$(EXPORT_VENV)/bin/python -m train.export "$(RUN)" --checkpoint "$(CHECKPOINT)" --format "$(FORMAT)" \
	  $(if $(MODEL),--model "$(MODEL)") $(if $(TASK),--task "$(TASK)")

onnx-setup: $(ONNX_VENV)/.installed ## ONNX export's environment: .venv plus docker/onnx.lock in .venv-onnx

$(ONNX_VENV)/.installed: docker/onnx.lock $(STAMP)
	@test -x $(ONNX_VENV)/bin/python || $(PY) -m venv --without-pip $(ONNX_VENV)
	@$(PY) -c '$(SEES_VENV)' $(ONNX_VENV)
	$(ONNX_VENV)/bin/python -m pip install $(PIP_LOCKED) -r docker/onnx.lock
	@$(ONNX_VENV)/bin/python -c '$(BYTECODE)'
	@touch $@

chaos: $(STAMP) ## fault drill: kill -9 / stop signals at random moments under torchrun, make and Slurm (CHAOS_ARGS=...)
	$(PY) -m tests.chaos $(CHAOS_ARGS)

build: $(LOCK) ## build the image (BuildKit); BASE_IMAGE=... another base, TORCH_FLAVOUR=... another CUDA
	@$(FETCH_BASE) $(BASE_IMAGE) --for $(IMAGE)
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/Dockerfile -t $(IMAGE) $(BUILD_FLAGS) \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg UID=$(HOST_UID) --build-arg GID=$(HOST_GID) \
	  --build-arg IMAGE_TAG=$(IMAGE) --build-arg GIT_COMMIT=$$(git rev-parse HEAD 2>/dev/null || echo unknown) \
	  --build-arg LOCK_FILE=$(LOCK) --build-arg LOCK_SHA256=$$(sha256sum $(LOCK) | cut -d' ' -f1) \
	  $(if $(EXTRA_CA),--secret id=extra_ca$(,)src=$(abspath $(EXTRA_CA))) .

image: ## build the image only if it is missing (warns when it was built from another commit)
	@$(DOCKER) image inspect $(IMAGE) >/dev/null 2>&1 || { $(FETCH_BASE) $(BASE_IMAGE) --for $(IMAGE) && \
	  $(MAKE) --no-print-directory build; }
	@$(PYTHON) -m train.hostenv --warn-stale $(IMAGE) --docker "$(DOCKER)"

shell: image $(ENV_FILE) ## a shell in the trainer container (NAS mounted, same user)
	@$(PYTHON) -m train.hostenv --check-writable --file $(ENV_FILE)
	$(COMPOSE_RUN) run --rm --entrypoint bash trainer

tensorboard: ## TensorBoard over the runs on 127.0.0.1:6006 (in the container or not: RUNTIME; docs/containers.md)
ifeq ($(RUNTIME),docker)
	@$(MAKE) --no-print-directory image $(ENV_FILE) && $(PYTHON) -m train.hostenv --service tensorboard --file $(ENV_FILE)
	TENSORBOARD_PORT=$(TENSORBOARD_PORT) $(COMPOSE_RUN) up tensorboard
else
	$(MAKE) --no-print-directory setup && $(VENV)/bin/tensorboard --logdir runs --host 127.0.0.1 --port $(TENSORBOARD_PORT)
endif

mlflow: ## MLflow server on 127.0.0.1:5000, store in runs/mlflow (MLFLOW_EXPOSE=1: a team server with a login)
ifeq ($(RUNTIME),docker)
	@$(MLFLOW_KNOBS) $(PYTHON) docker/mlflow_server.py --check runs
	@$(MAKE) --no-print-directory mlflow-image $(ENV_FILE)
	@$(MLFLOW_KNOBS) $(PYTHON) -m train.hostenv --service mlflow --file $(ENV_FILE)
	@# --force-recreate: started again, the server takes the settings and the password file as they are now
	$(MLFLOW_KNOBS) TRAINBOX_MLFLOW_IMAGE=$(MLFLOW_IMAGE) $(COMPOSE_RUN) up -d --force-recreate mlflow
	@echo "MLflow on http://$(MLFLOW_BIND):$(MLFLOW_PORT); compose runs track to it after:" \
	  "make env MLFLOW_TRACKING_URI=http://mlflow:5000"
else
	$(MAKE) --no-print-directory mlflow-setup && mkdir -p runs && \
	  $(MLFLOW_KNOBS) PATH=$(abspath $(MLFLOW_VENV))/bin:$$PATH $(MLFLOW_VENV)/bin/python docker/mlflow_server.py runs
endif

mlflow-user: ## a user for training jobs, not an admin (MLFLOW_USER=trainer; its password in ~/.mlflow-trainer)
	@$(MLFLOW_KNOBS) MLFLOW_USER_PASSWORD_FILE="$(MLFLOW_USER_PASSWORD_FILE)" \
	  $(PYTHON) docker/mlflow_server.py --add-user "$(MLFLOW_USER)"

mlflow-setup: $(MLFLOW_VENV)/.installed ## the MLflow server's local environment from docker/mlflow.lock (hash-checked)

$(MLFLOW_VENV)/.installed: docker/mlflow.lock
	@test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install $(PIP_LOCKED) -r docker/mlflow.lock
	@$(MLFLOW_VENV)/bin/python -c '$(BYTECODE)'
	@touch $@

mlflow-image: ## build the MLflow server image (docker/mlflow.Dockerfile) if it is missing
	@$(DOCKER) image inspect $(MLFLOW_IMAGE) >/dev/null 2>&1 || { \
	  $(FETCH_BASE) $(MLFLOW_BASE_IMAGE) --for $(MLFLOW_IMAGE) --knob MLFLOW_BASE_IMAGE && \
	  DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/mlflow.Dockerfile \
	  -t $(MLFLOW_IMAGE) $(BUILD_FLAGS) --build-arg BASE_IMAGE=$(MLFLOW_BASE_IMAGE) \
	  $(if $(EXTRA_CA),--secret id=extra_ca$(,)src=$(abspath $(EXTRA_CA))) .; }

sky-setup: $(SKY_VENV)/.installed ## SkyPilot in .venv-sky (tests/skypilot.lock), for sky launch slurm/skypilot.yaml

$(SKY_VENV)/.installed: tests/skypilot.lock
	@test -x $(SKY_VENV)/bin/python || $(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install $(PIP_LOCKED) -r tests/skypilot.lock
	@$(SKY_VENV)/bin/python -c '$(BYTECODE)'
	@touch $@

wds-setup: $(WDS_VENV)/.installed ## webdataset in .venv-wds (tests/webdataset.lock): the tests' writer of others' tars

$(WDS_VENV)/.installed: tests/webdataset.lock
	@test -x $(WDS_VENV)/bin/python || $(PYTHON) -m venv $(WDS_VENV)
	$(WDS_VENV)/bin/python -m pip install $(PIP_LOCKED) -r tests/webdataset.lock
	@$(WDS_VENV)/bin/python -c '$(BYTECODE)'
	@touch $@

hf-setup: $(HF_VENV)/.installed ## Hugging Face datasets in .venv-hf (tests/hf.lock): the tests' writer of HF datasets

$(HF_VENV)/.installed: tests/hf.lock
	@test -x $(HF_VENV)/bin/python || $(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install $(PIP_LOCKED) -r tests/hf.lock
	@$(HF_VENV)/bin/python -c '$(BYTECODE)'
	@touch $@

env: ## write .env: host UID/GID, NAS folders (DATA_DIR=..., RUNS_DIR=...), GPU or CPU compose files
	$(PYTHON) -m train.hostenv --file $(ENV_FILE) --image $(IMAGE) \
	  $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(if $(RUNS_DIR),--runs-dir $(RUNS_DIR)) \
	  $(if $(filter command line,$(origin MLFLOW_TRACKING_URI)),--mlflow-uri "$(MLFLOW_TRACKING_URI)")

$(ENV_FILE):
	@$(MAKE) --no-print-directory env

doctor: ## a report for bug reports: driver vs CUDA, GPUs, shm, port, NAS folders, all-reduce bandwidth
ifeq ($(RUNTIME),docker)
	@# On the host first: with a driver too old for the image's CUDA the container would not even start.
	$(PYTHON) -m train.hostenv --check-driver $(CUDA_$(TORCH_FLAVOUR))
	$(MAKE) --no-print-directory image $(ENV_FILE) && $(COMPOSE_RUN) run --rm --entrypoint python trainer -m train.doctor
else
	$(MAKE) --no-print-directory setup && \
	  $(PY) -m train.doctor $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(if $(RUNS_DIR),--runs-dir $(RUNS_DIR))
endif

enroot: ## the image as an enroot squashfs for pyxis (SQSH=trainbox.sqsh; needs enroot)
	@command -v enroot >/dev/null || { echo "error: enroot not found: install NVIDIA enroot where Docker runs," \
	  "or run this on a cluster login node" >&2; exit 2; }
	@$(MAKE) --no-print-directory image
	enroot import -o $(SQSH) dockerd://$(IMAGE)

apptainer: ## the image as an Apptainer SIF (SIF=trainbox.sif; needs apptainer)
	@command -v apptainer >/dev/null || { echo "error: apptainer not found: install Apptainer where Docker runs," \
	  "or run this on a cluster login node" >&2; exit 2; }
	@$(MAKE) --no-print-directory image
	apptainer build $(SIF) docker-daemon://$(IMAGE)

lock: ## re-resolve the lock of TORCH_FLAVOUR from pyproject.toml (needs uv; cu128/cu126 need download.pytorch.org)
	@mkdir -p $(dir $(LOCK))
	uv pip compile --generate-hashes $(LOCK_FLAGS) pyproject.toml -o $(LOCK)
	$(if $(filter cu130,$(TORCH_FLAVOUR)),uv pip compile --generate-hashes $(LOCK_FLAGS_cu130) docker/mlflow.in \
	  -o docker/mlflow.lock)
	$(if $(filter cu130,$(TORCH_FLAVOUR)),uv pip compile --generate-hashes $(LOCK_FLAGS_cu130) tests/skypilot.in \
	  -o tests/skypilot.lock)
	$(if $(filter cu130,$(TORCH_FLAVOUR)),uv pip compile --generate-hashes $(LOCK_FLAGS_cu130) tests/webdataset.in \
	  -o tests/webdataset.lock)
	$(if $(filter cu130,$(TORCH_FLAVOUR)),uv pip compile --generate-hashes $(LOCK_FLAGS_cu130) tests/hf.in \
	  -o tests/hf.lock)
	$(if $(filter cu130,$(TORCH_FLAVOUR)),uv pip compile --generate-hashes $(LOCK_FLAGS_cu130) docker/onnx.in \
	  -c requirements.lock -o docker/onnx.lock)

docker/locks/%.lock:
	@echo "error: $@ is missing: run 'make lock TORCH_FLAVOUR=$*' where download.pytorch.org is reachable," \
	  "then commit it" >&2
	@exit 2

clean: ## remove the local environment and caches (runs/ and the image are kept)
	rm -rf $(VENV) $(ONNX_VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

, := ,
