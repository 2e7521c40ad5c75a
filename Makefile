# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Read the no-deps pins from pyproject.toml, so that every pin stays in one place.
NO_DEPS = $(shell $(PYTHON) -c "import tomllib;print(' '.join(tomllib.load(open('pyproject.toml','rb'))['tool']['tandem']['no_deps']))")
PYTEST_ARGS ?=

.PHONY: demo test test-all lint clean-venv

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.base-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(NO_DEPS)
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.base-installed
	$(PIP) install -q -e ".[dev,tracking,data,megatron]"
	touch $@

DEMO_RECIPE ?= recipes/smollm2-135m/addition-grpo.yaml
DEMO_STAMP  := $(shell date +%Y%m%d-%H%M%S)
DEMO_DIR    ?= runs/demo-$(DEMO_STAMP)

# The main job: GRPO on SmolLM2-135M-Instruct (single-digit addition), colocated on CPU, then plots.
demo: $(VENV)/.base-installed
	$(VENV)/bin/tandem train $(DEMO_RECIPE) --run-dir $(DEMO_DIR) $(DEMO_ARGS)
	$(VENV)/bin/tandem report $(DEMO_DIR)

# The CI subset: everything except GPU tests and slow tests, plus the slow tests marked `ci`.
test: $(VENV)/.dev-installed
	$(PY) -m pytest -m "(not slow or ci) and not gpu" $(PYTEST_ARGS)

test-all: $(VENV)/.dev-installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check tandem tests bench

clean-venv:
	rm -rf $(VENV)
