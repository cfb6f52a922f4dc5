# midflight — the two commands of the README are `make drill` and `make test`.
# Every target bootstraps .venv from constraints.txt when it is missing or stale.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_FLAGS ?=

.PHONY: setup extras engine gpu-check drill demo test lint typecheck pytest docs docs-serve soak lock clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "midflight needs python3 >= 3.11, found " + sys.version.split()[0])'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing midflight and its pinned dependencies into $(VENV) (once; 30-95 s on 2 cores)..."
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

## The extras the fast tier's tests need: the transformers engine (`engine`), a local S3 API
## server with the S3 client (`s3-local`), and Ray (`ray`). The stamp names the set, so a venv made
## for an older set installs the new one.
ENGINE_STAMP := $(VENV)/.extras-engine-s3-ray

$(ENGINE_STAMP): $(STAMP)
	@echo "installing the engine, s3-local and ray extras (PyTorch CPU, transformers, obstore, moto, Ray) into $(VENV) (once; about 2 min)..."
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,engine,s3-local,ray]'
	@touch $(ENGINE_STAMP)

extras: $(ENGINE_STAMP)

## The old name of `extras`.
engine: $(ENGINE_STAMP)

## The main job: the crash-restore drill on its defaults (SIGKILLs real servers, proves exactly-once).
drill: $(STAMP)
	$(BIN)/midflight drill

## A short scripted tour of checkpoint storage and one participant through a SIGKILL.
demo: $(STAMP)
	$(BIN)/midflight demo

## The fast tier (CI): lint, types, tests, the docs build.
test: lint typecheck pytest docs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

## Two workers, one test file each at a time (module fixtures start their servers once).
PYTEST_WORKERS ?= -n 2 --dist loadfile

pytest: $(ENGINE_STAMP)
	$(BIN)/pytest -m "not soak" $(PYTEST_WORKERS) $(PYTEST_FLAGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(CURDIR)/.site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

## The vLLM engine's drill on a GPU machine (installs the vllm extra into .venv-gpu).
gpu-check:
	bash scripts/gpu-check.sh

## The long tier: many hypothesis examples and the big runs. Not in CI.
soak: $(ENGINE_STAMP)
	MIDFLIGHT_SOAK=1 HYPOTHESIS_PROFILE=soak $(BIN)/pytest $(PYTEST_FLAGS)

## Re-pin constraints.txt from the current .venv (after changing dependencies).
lock: $(STAMP)
	@{ echo "# Pinned versions of every dependency (runtime and dev). make installs with -c constraints.txt."; \
	   echo "# Regenerate after changing pyproject.toml: make lock"; \
	   $(BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(pip|setuptools|wheel)=='; } > constraints.txt

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache
